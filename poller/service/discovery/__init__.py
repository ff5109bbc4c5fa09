"""DNS discovery in the running poller: resolve SRV and A/AAAA sources (``resolve``)
and reconcile them into the registry under a fenced lease (``runner``). The settings
are ``poller.config.discovery``, the lease calls ``poller.store.discovery``."""
