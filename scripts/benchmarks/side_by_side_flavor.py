"""torchtitan's `--experimental.custom_import` module for side_by_side.py: adds the Llama 3 flavor
"side_by_side" to torchtitan v0.2.2's flavor table, with the shape side_by_side.py read from
titanlite's model (TransformerModelArgs fields as JSON in the environment variable below), so both
frameworks build the same model. torchtitan imports this module before it looks the flavor up;
its own files are not changed."""

import json
import os

from torchtitan.models.llama3 import TransformerModelArgs, llama3_args

FLAVOR = "side_by_side"
ENV = "TITANLITE_SIDE_BY_SIDE_ARGS"

if ENV not in os.environ:
    raise RuntimeError(f"side_by_side_flavor: {ENV} is not set (side_by_side.py sets it)")
llama3_args[FLAVOR] = TransformerModelArgs(**json.loads(os.environ[ENV]))
