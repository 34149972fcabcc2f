"""A field shared by several configs: defined once, taken as it is or
with another default or fewer choices whose reason its help gives."""

import dataclasses

import pytest

from fedjax_mr.core import config_tree


@dataclasses.dataclass(frozen=True)
class _Part:
  kind: str = config_tree.field(
    'a', 'How.', choices=('a', 'b', 'c'), flag='part_kind'
  )
  size: int = config_tree.field(3, 'How many.', run_only=True)


def test_a_shared_field_is_the_parts_own():
  @dataclasses.dataclass(frozen=True)
  class Flat:
    size: int = config_tree.shared(_Part, 'size')
    kind: str = config_tree.shared(_Part, 'kind')

  mine = {f.name: f for f in dataclasses.fields(Flat)}
  theirs = {f.name: f for f in dataclasses.fields(_Part)}
  for name in ('size', 'kind'):
    assert mine[name].metadata == theirs[name].metadata
    assert mine[name].default == theirs[name].default
  # In the tree of another config: the same flat name.
  assert [f.name for f in config_tree.fields(Flat)] == ['size', 'part_kind']


def test_another_default_or_fewer_choices_say_why():
  @dataclasses.dataclass(frozen=True)
  class Mine(_Part):
    kind: str = config_tree.shared(
      _Part, 'kind', default='b', choices=('a', 'b'), why='c is not here.'
    )

  f = {f.name: f for f in dataclasses.fields(Mine)}['kind']
  assert Mine().kind == 'b' and f.metadata['choices'] == ('a', 'b')
  assert (
    f.metadata['help'] == "How. Here default 'b' and only a, b: c is not here."
  )
  # The subclass keeps the part's order of fields.
  assert [g.name for g in dataclasses.fields(Mine)] == ['kind', 'size']


def test_a_changed_field_without_a_reason_is_refused():
  with pytest.raises(ValueError, match='why: default 4'):
    config_tree.shared(_Part, 'size', default=4)
  with pytest.raises(ValueError, match="name: _Part has no field 'sizes'"):
    config_tree.shared(_Part, 'sizes')
