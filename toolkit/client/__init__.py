"""The peer's only connection to the world: outbound HTTP(S) to the relay (and, when the relay's
plan has them, to the aggregators it names -- still outbound only).

One :class:`RelayClient` is composed of objects that each own their part, lowest first:

* :mod:`.transport`: a keep-alive ``requests.Session`` per destination, retries with exponential
  backoff (and the relay's Retry-After) for requests that are safe to repeat, and relay errors
  turned into typed exceptions carrying the relay's hint;
* :mod:`.params`: the bulk bodies, parameters downloaded straight into the model's flat buffer
  (whole, as a delta, or slice by slice from the aggregators that own them) and gradient slices
  uploaded to their owners in parallel;
* :mod:`.moe` and :mod:`.pipeline`: the expert and the stage routes;
* :mod:`.api`: :class:`RelayClient`, one typed method per core relay route, holding the transport
  and one object per concern above, each given that transport (no mixins: none reaches another's
  fields); a concern's routes are called on its object (``client.params``, ``client.moe``,
  ``client.pipeline``).

One client per thread: sessions are not shared. The bodies themselves (sized uploads, slice
parts, parameters read in place) are :mod:`toolkit.transfer`'s.
"""

from toolkit.client.api import RelayClient

__all__ = ["RelayClient"]
