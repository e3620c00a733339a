"""context-engine: assembles every model request an LLM agent sends.

The public Python surface is the gRPC contract (`context_engine.v1`) and the clients in
`clients/`; inside this package, `core` is the pure assembly library, `store` and `api`
are the shell around it.
"""

__all__ = ["__version__"]

__version__ = "0.1.0"
