"""How the relay runs as a service and whom it talks to: ``[server]``, ``[auth]``, ``[limits]``,
``[admin]``, ``[wandb]``, ``[hub]``, ``[aggregators]``.

Each section is a keyword-only dataclass with a docstring per field and a ``checks()`` method:
(holds, message) pairs that :meth:`relay_server.core.config.RelayConfig.validate` evaluates.
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass, field

from relay_server.core.typed import PATH

Checks = list[tuple[bool, str]]


@dataclass(kw_only=True)
class ServerSection:
    """``[server]``: where the relay listens and keeps its state."""

    host: str = "127.0.0.1"
    """Bind address. Keep 127.0.0.1 behind the README's TLS reverse proxy on the same host (the
    proxy is what the internet reaches); 0.0.0.0 only for a test on a private network without one."""
    port: int = 8750
    """TCP port (``relay-server serve --port 0``: any free one, reported by ``--ready-file``)."""
    data_dir: str = field(default="", metadata=PATH)
    """Everything that must survive a restart: SQLite store, parameters, optimizer state, the
    relay's key and admin token. Required to serve (here, ``RELAY_SERVER_DATA_DIR`` or ``--data-dir``);
    relative to the run's TOML file, so the relay finds its run from any working directory."""
    keep_checkpoints: int = 3
    """Older step files beyond this many are deleted."""
    fsync: bool = False
    """fsync state files: survives power loss, not just a process crash, at some cost per step."""
    upload_memory_mb: int = 1024
    """Gradient uploads in flight wait for their last chunk (whole-or-nothing) in memory up to
    this many MiB in total, beyond it in files in data_dir. Budget about peers x the model's
    upload size to keep rounds off the disk; lower it on a small VM (0: always on disk)."""
    public_params_url: str = ""
    """An HTTP cache in front of this relay (nginx ``proxy_cache``, a CDN), e.g.
    ``https://cache.example.org``: peers fetch each version's immutable body from there
    (``/api/params/v/...``, checked against the hash this relay signs) instead of from the relay.
    Empty: peers download from the relay, and it serves no immutable body URL."""

    def checks(self) -> Checks:
        """(holds, message) pairs for :meth:`RelayConfig.validate`."""
        url = self.public_params_url
        return [
            (0 <= self.port <= 65535, "server.port must be in 0..65535 (0 = any free port)"),
            (self.keep_checkpoints >= 1, "server.keep_checkpoints must be >= 1"),
            (self.upload_memory_mb >= 0, "server.upload_memory_mb must be >= 0 (0: uploads wait on disk)"),
            (
                not url or re.fullmatch(r"https?://[^/?#\s]+(/[^?#\s]*)?", url) is not None,
                f"server.public_params_url must be an http(s) URL without query or fragment, like "
                f"https://cache.example.org (got {url!r}); leave it empty to serve peers from the relay",
            ),
        ]


@dataclass(kw_only=True)
class AuthSection:
    """``[auth]``: who may join (Hugging Face login and an allowlist) and how long a pass lives."""

    mode: str = "hf"
    """"hf" (Hugging Face login + allowlist; the default) or "open" (anyone who can reach the
    relay may join and send gradients: local experiments only; logged loudly)."""
    hf_endpoint: str = ""
    """Identity provider for whoami (empty = HF_ENDPOINT or https://huggingface.co)."""
    allow_users: list[str] = field(default_factory=list)
    """Hugging Face usernames allowed to join (``RELAY_AUTH_ALLOW_USERS=alice,bob``)."""
    allow_orgs: list[str] = field(default_factory=list)
    """Hugging Face organizations whose members may join."""
    allow_any_hf_user: bool = False
    """Admit any Hugging Face account (identity, leaderboard and bans still apply)."""
    pass_ttl_s: float = 3600.0
    """Access pass lifetime; peers refresh at half-life."""
    reauth_after_s: float = 86400.0
    """Refresh passes without the HF token until this long after the last HF check."""
    max_skew_s: float = 60.0
    """Allowed clock offset of a signed request; nonces are remembered for twice this."""
    login_timeout_s: float = 15.0
    """Give up on the identity provider after this long (the login answers 503 with a hint)."""

    def checks(self) -> Checks:
        """(holds, message) pairs for :meth:`RelayConfig.validate`."""
        return [
            (self.mode in ("open", "hf"), "auth.mode must be 'open' or 'hf'"),
            (
                self.mode != "hf" or bool(self.allow_users or self.allow_orgs or self.allow_any_hf_user),
                "auth.mode = 'hf' needs auth.allow_users, auth.allow_orgs or auth.allow_any_hf_user = true "
                "(or auth.mode = 'open' for a local experiment)",
            ),
            (
                all(name.strip() for name in self.allow_users + self.allow_orgs),
                "auth.allow_users and auth.allow_orgs must not hold empty names",
            ),
            (self.pass_ttl_s >= 60 and self.max_skew_s > 0, "auth.pass_ttl_s must be >= 60 and auth.max_skew_s > 0"),
        ]


@dataclass(kw_only=True)
class LimitsSection:
    """``[limits]``: token buckets per user (signed requests) or per address (everything unsigned):
    a bucket holds ``*_burst`` requests and refills at ``*_per_s``. Sized to stop floods, not to
    shape a well-behaved peer: a refused heartbeat costs a peer nothing (it reports again next step)."""

    enabled: bool = True
    """Turn every limit off (a benchmark on a private network)."""
    exempt_loopback: bool = True
    """Do not limit unsigned requests from 127.0.0.1/::1 (a local experiment: every peer, script
    and dashboard is loopback). Signed requests are limited per user wherever they come from.
    Logins are limited on loopback too (see ``exempt_loopback_logins``)."""
    exempt_loopback_logins: bool = False
    """Also exempt logins from loopback. Off: behind a proxy that sends no X-Forwarded-For every
    volunteer is 127.0.0.1, and would share one unlimited bucket of whoami calls."""
    trust_forwarded_for: bool = True
    """A loopback request with X-Forwarded-For came through a reverse proxy on this host (the README's
    Caddy / nginx): key it by the header's last hop, for the rate limits, the per-address connection
    and upload-byte caps and the loopback exemptions alike (relay_server.core.client_address). No
    other address may name itself."""
    poll_per_s: float = 50.0
    """Heartbeats, progress and state polls, leave, shard leases: frequent and cheap."""
    poll_burst: float = 500.0
    """Poll requests a bucket holds."""
    transfer_per_s: float = 20.0
    """Gradient uploads and parameter downloads: one or two per round per peer."""
    transfer_burst: float = 200.0
    """Transfers a bucket holds."""
    join_per_s: float = 0.5
    """Joins: each one adds a registry entry and a database row."""
    join_burst: float = 30.0
    """Joins a bucket holds."""
    login_per_s: float = 0.2
    """Logins and pass refreshes, per address (a login calls Hugging Face's rate-limited whoami)."""
    login_burst: float = 10.0
    """Logins a bucket holds."""
    observe_per_s: float = 10.0
    """Unsigned reads per address: status, run, the dashboard (which polls every 1.5 s)."""
    observe_burst: float = 100.0
    """Unsigned reads a bucket holds."""
    tasks_per_s: float = 400.0
    """Expert calls, task polls and results ([moe]: a trainer makes k x layers x 2 per micro-batch)."""
    tasks_burst: float = 4000.0
    """Expert calls, polls and results a bucket holds."""
    auth_failures_per_s: float = 1.0
    """Refused signed requests (bad pass, signature, nonce...) per address: past this the
    address is answered 429 before any signature is checked."""
    auth_failures_burst: float = 50.0
    """Refused signed requests a bucket holds."""

    def checks(self) -> Checks:
        """(holds, message) pairs for :meth:`RelayConfig.validate`."""
        rates = [getattr(self, f.name) for f in dataclasses.fields(self) if f.name.endswith(("_per_s", "_burst"))]
        return [
            (
                all(r > 0 for r in rates),
                "every limits.*_per_s and limits.*_burst must be > 0 (limits.enabled = false turns them off)",
            )
        ]


@dataclass(kw_only=True)
class AdminSection:
    """``[admin]``: the organizer's token for moderation."""

    token_file: str = field(default="", metadata=PATH)
    """The organizer's admin token for /api/admin and ``relay-server admin`` (empty =
    <server.data_dir>/admin_token, generated 0600 on first start); relative to the run's TOML file."""


@dataclass(kw_only=True)
class WandbSection:
    """``[wandb]``: the collaboration's metrics in Weights & Biases."""

    project: str = ""
    """Weights & Biases project for the collaboration's metrics (empty = no W&B logging)."""
    entity: str = ""
    """W&B team or user (empty = the API key's default entity)."""
    mode: str = ""
    """"online", "offline" or "disabled"; empty = W&B's own default (or WANDB_MODE)."""

    def checks(self) -> Checks:
        """(holds, message) pairs for :meth:`RelayConfig.validate`."""
        return [
            (
                self.mode in ("", "online", "offline", "disabled"),
                "wandb.mode must be online, offline, disabled or empty",
            )
        ]


@dataclass(kw_only=True)
class HubSection:
    """``[hub]``: checkpoints uploaded to, and a run started from, the Hugging Face Hub."""

    repo_id: str = ""
    """Hugging Face Hub model repo that receives checkpoints (empty = no uploads)."""
    every_steps: int = 0
    """Upload a checkpoint every this many steps (0 = never)."""
    private: bool = True
    """Create the repo as private if it does not exist."""
    endpoint: str = ""
    """Hub API endpoint (empty = HF_ENDPOINT or https://huggingface.co)."""
    token_env: str = "HF_TOKEN"
    """Name of the environment variable holding the organizer's write token (never put the token here)."""
    init_from: str = ""
    """Start a new run from a Hub checkpoint: "repo_id" or "repo_id@revision" (ignored on restart)."""

    def checks(self) -> Checks:
        """(holds, message) pairs for :meth:`RelayConfig.validate`."""
        return [
            (self.every_steps >= 0, "hub.every_steps must be >= 0"),
            (not self.every_steps or bool(self.repo_id), "hub.every_steps needs hub.repo_id"),
            (
                not self.init_from or bool(re.fullmatch(r"[\w.-]+/[\w.-]+(@[^@\s]+)?", self.init_from)),
                "hub.init_from must be 'owner/name' or 'owner/name@revision'",
            ),
        ]


@dataclass(kw_only=True)
class AggregatorsSection:
    """``[aggregators]``: extra aggregator servers (``relay-server aggregator``) and the plan that
    slices the vector among them and the relay (DESIGN.md s5-6). Without registered aggregators
    none of this runs."""

    heartbeat_interval_s: float = 1.0
    """How often aggregators report to the relay."""
    ttl_s: float = 5.0
    """An aggregator silent this long is dead: the next round recovers its slice and re-plans."""
    call_timeout_s: float = 30.0
    """Relay -> aggregator calls (finalize, assign, state pulls) fail after this long; a failed
    finalize marks the aggregator dead."""
    default_bandwidth_mbps: float = 100.0
    """Bandwidth assumed for a link until a real transfer measured it (Mbit/s)."""
    replan_interval_s: float = 10.0
    """Solve the plan at most this often for changed measurements (membership changes: 1 s)."""
    replan_change: float = 0.2
    """A measurement moving by more than this fraction since the last solve is a material change."""
    min_share_change: float = 0.05
    """Move slices only when some owner's share moves by more than this (a move costs two
    transfers of the whole state through the relay)."""
    state_copy_every: int = 10
    """Pull every aggregator's optimizer state into the relay's recovery copy every this many
    steps (parameters are pulled every ``params_copy_every`` steps)."""
    params_copy_every: int = 1
    """Pull every remote slice's published parameters into the relay's recovery copy every this
    many steps: 1 keeps a recovered slice at most one step old, at the price of the remote
    parameters crossing the relay's link (inbound) every step; ``state_copy_every`` pulls them
    only with the optimizer state (a recovered slice is then up to that many steps old). The
    relay's link load per step under the plan is in ``/api/plan`` (``relay_link``)."""

    def checks(self) -> Checks:
        """(holds, message) pairs for :meth:`RelayConfig.validate`."""
        return [
            (
                self.ttl_s > self.heartbeat_interval_s > 0,
                "aggregators.ttl_s must exceed aggregators.heartbeat_interval_s (> 0)",
            ),
            (self.default_bandwidth_mbps > 0, "aggregators.default_bandwidth_mbps must be > 0"),
            (self.state_copy_every >= 1, "aggregators.state_copy_every must be >= 1"),
            (self.params_copy_every >= 1, "aggregators.params_copy_every must be >= 1 (1 = after every step)"),
        ]
