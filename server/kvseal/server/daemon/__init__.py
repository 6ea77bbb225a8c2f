"""The process around the cache: ``kvseal-server``'s pieces (``main`` is the entry point).

- ``cli``           the command line and its ``KVSEAL_*`` variables -> ``ServerConfig``;
- ``daemon``        :class:`~kvseal.server.daemon.daemon.Daemon`: build, bind, serve,
  drain, stop; ``make_backend`` picks CPU or CUDA;
- ``socket_access`` the public socket's mode, group and directories;
- ``process``       logging, process hardening, systemd notification.

Nothing is imported here.
"""
