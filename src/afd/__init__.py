"""afd: Attention-FFN disaggregated serving of DeepSeek-V2/V3 MoE models."""

import logging

__version__ = "0.1.0"
logging.getLogger("afd").addHandler(logging.NullHandler())
