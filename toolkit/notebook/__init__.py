"""What a volunteer sees in a notebook: secrets and platform hints (:mod:`.hints`), the live panel
(:mod:`.panel`) and the peer's own W&B run (:mod:`.wandb_run`). ``toolkit.notebook.hf_token()`` and
``toolkit.notebook.show_hints()`` are the calls the shipped notebooks make."""

from toolkit.notebook.hints import hf_token, platform_hints, show_hints

__all__ = ["hf_token", "platform_hints", "show_hints"]
