"""Block copies between the engine's KV tensors and staging slots.

``interface`` (the ``BlockCopier`` protocol), ``torch_copy`` (torch copies: the CPU path
and the reference), ``cuda_copy`` (one CUDA kernel launch per batch, CuPy) and
``factory`` (``make_block_copier``: which executor for ``copy_backend``). Importing this
package never needs CuPy.
"""
