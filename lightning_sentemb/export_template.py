"""Old import path of `TemplateSentenceEncoder`, named in the modules.json of PromptBERT/ConPVP
exports written before it moved to `lightning_sentemb.export.template`; kept so they still load."""

from .export.template import TemplateSentenceEncoder

__all__ = ["TemplateSentenceEncoder"]
