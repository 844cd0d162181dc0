"""The webhooks service (``loopmesh webhooks``): turns' events POSTed to their
webhooks, signed, retried with backoff and dead-lettered (see :mod:`.service`)."""
