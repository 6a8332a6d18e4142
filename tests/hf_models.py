"""Temporary re-export of tests/support/hf_models.py for tests/test_mtp_decoding.py and tests/test_hf_patch.py,
which import ``tests.hf_models`` until the lead moves them (issue 22). Delete this file with that move;
tests/test_layout.py allows it only through ``AWAITING_LEAD_MOVE``."""

from tests.support.hf_models import FAMILIES, VARIED, save_bitnet_packed, tiny_config, tiny_model  # noqa: F401
