"""Services for routers: the prefix lookup (how much of a prompt the shared cache holds)
and its HTTP front. They read Redis through the store; no engine, CLI or test fixture."""
