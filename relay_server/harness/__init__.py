"""Running a relay on this machine: the one way the demo, the tests and the benchmarks do it.

* :mod:`.thread` -- :class:`~relay_server.harness.thread.RelayThread`, the relay (or any aiohttp
  app) served from an event loop on a thread of this process: ``relay-server demo``'s relay and
  the tests' in-process relays;
* :mod:`.process` -- ``relay-server serve`` / ``aggregator`` as processes, started as an organizer
  starts them (port 0, ``--ready-file``, one log each), restarted on the same port, stopped
  cleanly; :func:`~relay_server.harness.process.wait_until`;
* :mod:`.zygote` -- Python processes forked from one that imported torch once (a real child
  each, as ``subprocess.Popen`` gives): the test suite's relays, peers and workers start in a
  fraction of a second instead of seconds of imports;
* :mod:`.nginx` -- a real nginx in front of a relay (the TLS proxy, the parameter cache);
* :mod:`.latency_proxy` -- a TCP proxy that adds latency and counts bytes;
* :mod:`.netns` -- hosts with shaped links (network namespaces, veth, ``tc``);
* :mod:`.manual_peer` -- a peer driven by hand (join, heartbeats, any request of its own) through
  a client its caller built: the tests' and the benchmarks' hostile hosts and hand-made trainers;
* :mod:`.dishonest` -- stage workers that send finite, well shaped, wrong results (the trust
  tests' and ``benchmarks/trust.py``'s liars: one set of attacks for both);
* :mod:`.hf_standin` -- a local stand-in for the Hugging Face Hub's identity API (and the routes a
  test adds), so that hf-mode runs log in without the internet.

Nothing in the relay's serving path imports this package; it sits above ``api`` (it serves the
relay's app) and below the ``demo`` entry point. Each module is imported by name (no re-exports
here), so that starting a process does not import the relay's app.
"""
