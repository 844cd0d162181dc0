"""The loop worker: the agent loop engine and the service that runs turns durably.

The engine is the subpackage ``loop_worker.engine``: pure (``Engine`` over the Protocols
of ``engine/protocols.py``, no NATS); ``engine.inmemory`` runs it in one process. The
modules beside it (``service``, ``lease``, ``store``, ``sink``, ``dispatch``,
``controls``, ``client``, ``cli``, ``config``) are the durable service on NATS.
"""

from .engine import *  # noqa: F403 (the engine's public names: its __all__)
from .engine import __all__ as __all__
