"""The parameter cache as the tests and ``benchmarks/egress.py`` run it: the shipped nginx config
(``examples/nginx_params_cache.conf``) with this machine's port, relay and cache directory."""

from __future__ import annotations

from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
CACHE_CONF = REPO / "examples" / "nginx_params_cache.conf"


def cache_http_block(port: int, upstream: int, cache_dir: Path) -> str:
    """``examples/nginx_params_cache.conf`` as written, but plain HTTP on 127.0.0.1:``port``
    (tests/test_proxy.py covers nginx's TLS) in front of the relay on ``upstream``."""
    text = CACHE_CONF.read_text()
    for old, new in (("listen 443 ssl;", f"listen 127.0.0.1:{port};"),
                     ("    ssl_certificate     /etc/letsencrypt/live/cache.example.org/fullchain.pem;\n", ""),
                     ("    ssl_certificate_key /etc/letsencrypt/live/cache.example.org/privkey.pem;\n", ""),
                     ("        proxy_ssl_server_name on;\n", ""),
                     ("proxy_pass https://relay.example.org;", f"proxy_pass http://127.0.0.1:{upstream};"),
                     ("/var/cache/nginx/collab-params", str(cache_dir))):
        assert old in text, f"{CACHE_CONF.name} no longer has {old!r}: update tests/support/http_cache.py with it"
        text = text.replace(old, new)
    return text
