"""The shared runtime and the ``loopmesh`` command.

Settings (:mod:`loopmesh.settings`), the NATS connection (:mod:`loopmesh.nats`), stream
provisioning (:mod:`loopmesh.provision`), the embedded nats-server
(:mod:`loopmesh.server`), logging, metrics and shutdown. Import the module you need;
this package imports nothing on its own so that ``loopmesh --help`` stays quick.
"""
