import pytest
import torch

from mars_ray.core.dtypes import DTYPE_NAMES, torch_dtype
from mars_ray.core.errors import ConfigError


def test_each_name_maps_to_its_torch_dtype():
    assert torch_dtype("auto") is None
    assert [torch_dtype(name) for name in DTYPE_NAMES[1:]] == [torch.float32, torch.bfloat16, torch.float16]


@pytest.mark.parametrize("name", ["int8", "torch.float32", "", "Auto"])
def test_unknown_name_is_a_config_error_on_dtype(name):
    with pytest.raises(ConfigError) as error:
        torch_dtype(name)
    assert error.value.field == "dtype"
