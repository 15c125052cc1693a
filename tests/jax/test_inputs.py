"""Input kinds whose parity is backend-specific (see tests/tensorflow/test_inputs.py)."""

from tests.helpers import check_pydataset_parity


def test_pydataset_input():
    check_pydataset_parity()
