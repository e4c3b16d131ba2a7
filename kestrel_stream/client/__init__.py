"""Clients of the daemon's socket protocol: ``Client`` (blocking) and ``AsyncClient`` (anyio)."""
from kestrel_stream.client.sync import Client, RemoteSession, TopK, connect, parse_address
from kestrel_stream.client.anyio_client import AsyncClient, AsyncRemoteSession

__all__ = ["Client", "AsyncClient", "RemoteSession", "AsyncRemoteSession", "TopK", "connect", "parse_address"]
