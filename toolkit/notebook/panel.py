"""The live panel a volunteer watches while ``toolkit.join`` trains.

One typed snapshot, :class:`PeerProgress`, is built from the optimizer after every local step;
a :class:`Panel` shows it. Three panels, picked by :func:`open_panel`:

* ``"widgets"``: an ipywidgets box in the notebook (progress bar toward the next global step and
  a small table), updated in place. When it closes, the box is replaced by a static copy of its
  last state and the widget models are closed, so a re-run cell leaves no live widgets behind.
* ``"tqdm"``: one ``tqdm.auto`` bar over global steps with the same numbers in its postfix (for
  terminals and scripts); a new problem is written once above the bar.
* ``"none"``: shows nothing.

``"auto"`` picks widgets inside a Jupyter kernel that can show them, tqdm when stderr is a
terminal, and nothing otherwise (a peer whose stderr goes to a log file must not fill it with
progress bars).

Panels own no thread: the training loop calls :meth:`Panel.update` as often as it likes and the
panel re-renders at most every ``interval_s`` seconds (2 Hz by default), so output never floods.
:meth:`Panel.close` always renders the latest snapshot, throttled or not.
"""

from __future__ import annotations

import functools
import html
import importlib.util
import logging
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import IO, TYPE_CHECKING, Any, Literal, Protocol

if TYPE_CHECKING:
    from toolkit.optimizer import CollaborativeOptimizer

log = logging.getLogger(__name__)

PanelKind = Literal["auto", "widgets", "tqdm", "none"]
DEFAULT_INTERVAL_S = 0.5


@dataclass(frozen=True, kw_only=True)
class PeerProgress:
    """What the volunteer sees, at one moment. Collaboration-wide numbers come from the relay's
    last answer (``CollabState``); "local" ones are this peer's."""

    peers_online: int
    samples_per_s: float
    """The whole collaboration's throughput, as the relay sums it."""
    global_step: int
    total_steps: int
    """0: the run has no planned end."""
    samples_accumulated: int
    """Samples the collaboration has gathered toward the next step (of ``target_batch``)."""
    target_batch: int
    eta_s: float | None
    """Relay's estimate of the seconds until the next global step (None: unknown yet)."""
    contributed_samples: int
    """This peer's samples that went into applied steps."""
    local_samples_per_s: float
    loss: float | None
    """This peer's loss on its last micro-batch."""
    first_contribution_s: float | None
    """Seconds from this peer's join to the relay accepting its first gradient, as the relay
    measured it: the dashboard's "first contribution" for this peer (None: not yet)."""
    problem: str | None = None
    hint: str | None = None
    finished: bool = False
    hosting: str | None = None
    """An expert host's own line (``join(role="expert_host")``): what it hosts and serves; it
    then trains nothing, so its contribution, loss and first contribution are not shown."""
    local_sgd: str | None = None
    """``run.mode = "local_sgd"``: where this peer's inner loop stands, e.g. "inner step 12 of 30,
    4 outer rounds counted, 0 late, busy 93 %" (:func:`local_sgd_line`)."""

    @classmethod
    def from_optimizer(
        cls, opt: "CollaborativeOptimizer", *, loss: float | None, first_contribution_s: float | None
    ) -> "PeerProgress":
        state, error = opt.collab_state, opt.last_error
        # Parameters newer than the last heartbeat's answer mean that answer's round is over: its
        # accumulation and ETA describe a step that already happened.
        stale = opt.version > state.step
        return cls(
            peers_online=state.num_peers,
            samples_per_s=state.samples_per_s,
            global_step=max(state.step, opt.version),
            total_steps=opt.run.total_steps,
            samples_accumulated=0 if stale else state.samples_accumulated,
            target_batch=state.target_batch,
            eta_s=None if stale else state.eta_s,
            contributed_samples=opt.contributed_samples,
            local_samples_per_s=opt.samples_per_s,
            loss=loss,
            first_contribution_s=first_contribution_s,
            problem=error.message if error else None,
            hint=error.hint if error else None,
            finished=opt.finished or state.finished,
            local_sgd=local_sgd_line(local) if (local := getattr(opt, "local_sgd", None)) is not None else None,
        )

    def rows(self) -> list[tuple[str, str]]:
        """(label, value) pairs, in display order; every panel renders these same strings."""
        step = f"{self.global_step:,}" + (f" / {self.total_steps:,}" if self.total_steps else "")
        if self.finished:
            step += " (run finished)"
        eta = "unknown" if self.eta_s is None else f"~{_duration(self.eta_s)}"
        first = "waiting..." if self.first_contribution_s is None else f"{self.first_contribution_s:.1f} s after join"
        problem = "none" if self.problem is None else self.problem + (f" -- {self.hint}" if self.hint else "")
        if self.hosting is not None:
            return [
                ("peers online", f"{self.peers_online}"),
                ("collaboration", f"{self.samples_per_s:,.1f} samples/s"),
                ("global step", step),
                ("you host", self.hosting),
                ("last problem", problem),
            ]
        return [
            ("peers online", f"{self.peers_online}"),
            ("collaboration", f"{self.samples_per_s:,.1f} samples/s"),
            ("global step", step),
            ("next step", f"{eta} ({self.samples_accumulated:,} / {self.target_batch:,} samples)"),
            ("your contribution", f"{self.contributed_samples:,} samples ({self.local_samples_per_s:,.1f} samples/s)"),
            ("loss", "n/a" if self.loss is None else f"{self.loss:.4f}"),
            ("first contribution", first),
            *([("local SGD", self.local_sgd)] if self.local_sgd is not None else []),
            ("last problem", problem),
        ]


def local_sgd_line(local: Any) -> str:
    """A local SGD peer's state (a :class:`toolkit.optimizer.local_sgd.LocalSgd`, only read): the
    inner step it is at, of H when the budget counts steps; the outer rounds its pseudo-gradients
    counted in and those that came too late (dropped); its busy fraction once measured."""
    of = f" of {local.inner_steps}" if local.inner_steps else ""
    busy = "busy: not measured yet" if local.busy_fraction is None else f"busy {100 * local.busy_fraction:.0f} %"
    return (
        f"inner step {local.steps}{of}, {local.outer_rounds} outer round{'' if local.outer_rounds == 1 else 's'} "
        f"counted, {local.late_rounds} late, {busy}"
    )


class Panel(Protocol):
    """Anything that shows progress: fed from the training loop, closed once at the end."""

    def update(self, progress: PeerProgress) -> None: ...

    def close(self) -> None: ...


class _Throttled:
    """Render at most every ``interval_s`` seconds; :meth:`close` renders the latest snapshot."""

    def __init__(self, interval_s: float, clock: Callable[[], float]) -> None:
        self.interval_s, self._clock = interval_s, clock
        self._last_render = float("-inf")
        self.latest: PeerProgress | None = None
        self.renders = 0
        self.closed = False

    def update(self, progress: PeerProgress) -> None:
        if self.closed:
            return
        self.latest = progress
        now = self._clock()
        if now - self._last_render >= self.interval_s:
            self._last_render = now
            self._draw(progress)

    def close(self) -> None:
        if self.closed:
            return
        if self.latest is not None:
            self._draw(self.latest)
        self.closed = True
        self._release()

    def _draw(self, progress: PeerProgress) -> None:
        self.renders += 1
        self._render(progress)

    def _render(self, progress: PeerProgress) -> None:
        raise NotImplementedError

    def _release(self) -> None:
        """Free what the panel holds (widgets, the bar); runs once, after the last render."""


class NullPanel:
    """Shows nothing (``panel="none"``)."""

    def update(self, progress: PeerProgress) -> None:
        pass

    def close(self) -> None:
        pass


class WidgetPanel(_Throttled):
    """An ipywidgets box: a bar of samples toward the next global step, and a table."""

    def __init__(
        self,
        title: str,
        *,
        interval_s: float = DEFAULT_INTERVAL_S,
        clock: Callable[[], float] = time.monotonic,
        show: bool = True,
    ) -> None:
        super().__init__(interval_s, clock)
        import ipywidgets as widgets

        self.title = title
        self.bar = widgets.IntProgress(value=0, min=0, max=1, description="next step", bar_style="info")
        self.table = widgets.HTML(value="<i>joining...</i>")
        self.box = widgets.VBox([widgets.HTML(value=f"<b>{html.escape(title)}</b>"), self.bar, self.table])
        self._handle = _display(self.box) if show else None

    def _render(self, progress: PeerProgress) -> None:
        self.bar.max = max(1, progress.target_batch)
        self.bar.value = min(progress.samples_accumulated, self.bar.max)
        self.bar.bar_style = "warning" if progress.problem else ("success" if progress.finished else "info")
        self.table.value = _html_table(progress)

    def _release(self) -> None:
        # The frontend would show a blank box once the models close, so the output keeps a static
        # copy of the final state instead; closing the models is what lets a re-run cell start clean.
        if self._handle is not None and self.latest is not None:
            from IPython.display import HTML

            self._handle.update(HTML(f"<b>{html.escape(self.title)}</b>{_html_table(self.latest)}"))
        for child in self.box.children:
            child.close()
        self.box.close()


class TqdmPanel(_Throttled):
    """One ``tqdm.auto`` bar over global steps; numbers in the postfix; problems written once."""

    def __init__(
        self,
        title: str,
        *,
        interval_s: float = DEFAULT_INTERVAL_S,
        clock: Callable[[], float] = time.monotonic,
        file: IO[str] | None = None,
    ) -> None:
        super().__init__(interval_s, clock)
        self._file = file
        self._shown_problem: str | None = None
        self._joined_at_step: int | None = None
        self._closing = False
        self._on_screen: PeerProgress | None = None
        self.bar = _quiet_tqdm()(desc=title, unit="step", file=file, leave=True, mininterval=0, dynamic_ncols=True)

    def _render(self, progress: PeerProgress) -> None:
        if progress.problem and progress.problem != self._shown_problem:
            self._shown_problem = progress.problem
            self.bar.write(
                f"problem: {progress.problem}" + (f" -- {progress.hint}" if progress.hint else ""), file=self._file
            )
        if progress.total_steps and self.bar.total != progress.total_steps:
            self.bar.total = progress.total_steps
        if self._joined_at_step is None:  # steps/s counts the steps seen here, not the run's steps before we joined
            self._joined_at_step = self.bar.initial = progress.global_step
        self.bar.n = progress.global_step
        values = dict(progress.rows())
        local = f" | {progress.local_sgd}" if progress.local_sgd is not None else ""
        self.bar.set_postfix_str(
            f"peers {values['peers online']} | {values['collaboration']} | next {values['next step']} | "
            f"you {progress.contributed_samples:,} samples | loss {values['loss']} | "
            f"first {values['first contribution']}{local}",
            refresh=False,
        )
        if not self._closing:  # the bar's close() draws the final line, once
            self.bar.refresh()
            self._on_screen = progress

    def close(self) -> None:
        self._closing = True
        super().close()

    def _release(self) -> None:
        if self.latest is not None and self._on_screen is self.latest:
            # The final state is already drawn: end its line, and let tqdm's close() skip its own redraw
            # (it skips bars it considers never shown), or logs get the last line twice.
            self.bar.fp.write("\n")
            self.bar.delay = float("inf")
        self.bar.close()


def open_panel(kind: PanelKind | Panel, title: str, *, interval_s: float = DEFAULT_INTERVAL_S) -> Panel:
    """The panel ``kind`` names (a ready-made :class:`Panel` is returned as is)."""
    if not isinstance(kind, str):
        return kind
    if kind == "auto":
        kind = "widgets" if widgets_available() else ("tqdm" if _is_terminal(sys.stderr) else "none")
    if kind == "widgets":
        from toolkit.notebook.hints import enable_widgets

        enable_widgets()
        return WidgetPanel(title, interval_s=interval_s)
    if kind == "tqdm":
        return TqdmPanel(title, interval_s=interval_s)
    if kind == "none":
        return NullPanel()
    raise ValueError(f"panel must be 'auto', 'widgets', 'tqdm', 'none' or a Panel, got {kind!r}")


def widgets_available() -> bool:
    """True inside a Jupyter kernel (not plain IPython) where ipywidgets imports."""
    if importlib.util.find_spec("ipywidgets") is None:
        return False
    try:
        from IPython import get_ipython
    except ImportError:
        return False
    shell = get_ipython()
    return shell is not None and getattr(shell, "kernel", None) is not None


# --- rendering helpers -----------------------------------------------------------------------
def _html_table(progress: PeerProgress) -> str:
    cells = []
    for label, value in progress.rows():
        style = ' style="color:#b00"' if label == "last problem" and progress.problem else ""
        cells.append(
            f"<tr><td style='padding-right:1em'>{html.escape(label)}</td><td{style}>{html.escape(value)}</td></tr>"
        )
    return "<table>" + "".join(cells) + "</table>"


def _duration(seconds: float) -> str:
    seconds = max(0.0, seconds)
    if seconds < 90:
        return f"{seconds:.0f} s"
    if seconds < 5400:
        return f"{seconds / 60:.0f} min"
    return f"{seconds / 3600:.1f} h"


def _display(widget: Any) -> Any:
    from IPython.display import display

    return display(widget, display_id=True)


def _is_terminal(stream: Any) -> bool:
    isatty = getattr(stream, "isatty", None)
    try:
        return bool(isatty and isatty())
    except (ValueError, OSError):  # a closed stream
        return False


@functools.cache
def _quiet_tqdm() -> type:
    """``tqdm.auto.tqdm`` without its monitor thread: the panel owns no thread, and the bar is
    refreshed by :meth:`TqdmPanel.update` anyway."""
    from tqdm.auto import tqdm

    return type("PanelBar", (tqdm,), {"monitor_interval": 0})
