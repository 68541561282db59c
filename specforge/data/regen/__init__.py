"""Regenerate assistant turns with the target (embedded transformers or OpenAI-compatible servers).

Entry point: `regenerate_conversations` (see run.py for the files it writes, replay.py for what
happens to a conversation that cannot be regenerated)."""
from specforge.data.regen.replay import KEEP_ORIGINAL, SKIP, RegenFailure
from specforge.data.regen.run import regenerate_conversations

__all__ = ["KEEP_ORIGINAL", "SKIP", "RegenFailure", "regenerate_conversations"]
