"""Old import path of `PrefixedTransformer`, named in the modules.json of DCPCSE exports written
before it moved to `lightning_sentemb.export.prefix`; kept so they still load."""

from ..export.prefix import PrefixedTransformer

__all__ = ["PrefixedTransformer"]
