"""The store: asyncpg repositories over migrations/. The only room that speaks SQL.

Every function takes a connection and a tenant id; every query is tenant-scoped.
"""

from .db import StoreUnavailableError, connect_pool, transaction
from .migrate import apply_migrations

__all__ = ["StoreUnavailableError", "apply_migrations", "connect_pool", "transaction"]
