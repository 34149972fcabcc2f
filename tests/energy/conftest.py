"""Fixtures of the energy tests: fake TX2 and Orin trees with a kernel."""

import pytest

from fedjax_mr.energy import profiles
from tests.energy import fake_sysfs


@pytest.fixture
def clock():
  return fake_sysfs.FakeClock()


@pytest.fixture
def tx2(tmp_path):
  """A TX2 tree whose rails follow the literal Table II profile."""
  fake_sysfs.build_tx2_tree(tmp_path)
  return fake_sysfs.FakeKernel(
    tmp_path, profiles.TX2_TABLE2_LITERAL, fake_sysfs.TX2_RAIL_SHARES
  )


@pytest.fixture
def orin(tmp_path):
  """An AGX Orin (JetPack 5) tree whose rails follow the Orin test profile."""
  fake_sysfs.build_orin_tree(tmp_path)
  return fake_sysfs.FakeKernel(
    tmp_path, fake_sysfs.ORIN_TEST_PROFILE, fake_sysfs.ORIN_RAIL_SHARES
  )
