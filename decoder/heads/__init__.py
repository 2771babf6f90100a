"""Draft heads: small layers that draft from the target's own hidden states (EAGLE-3), their weights and their
speculators-layout folders. ``model.py`` is the head and its cache; ``layout.py`` loads and saves it."""

from decoder.heads.layout import LoadedHead, load_head, save_head
from decoder.heads.model import EagleHead, HeadCache, HeadShape

__all__ = ["EagleHead", "HeadCache", "HeadShape", "LoadedHead", "load_head", "save_head"]
