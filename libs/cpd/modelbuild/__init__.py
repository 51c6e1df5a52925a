"""The locally built model (no model hub is reachable): ``build`` and its presets."""

from cpd.modelbuild.build import (
           MANIFEST,
           PRESETS,
           RECIPE_VERSION,
           Preset,
           build,
           model_dir,
           tokenizer_hash,
           verify,
           weights_revision,
)

__all__ = ["MANIFEST", "PRESETS", "RECIPE_VERSION", "Preset", "build", "model_dir",
           "tokenizer_hash", "verify", "weights_revision"]
