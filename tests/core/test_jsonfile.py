"""The bounded, typed JSON reader: every failure one line naming the file
and the field."""

import os
import socket

import pytest

from fedjax_mr.core import errors
from fedjax_mr.core import jsonfile


def _file(tmp_path, content, name='f.json'):
  path = tmp_path / name
  path.write_bytes(content if isinstance(content, bytes) else content.encode())
  return str(path)


def _reason(call, *args, **kwargs) -> str:
  with pytest.raises(jsonfile.JsonFileError) as e:
    call(*args, **kwargs)
  assert isinstance(e.value, errors.UserError)
  assert str(e.value) == f'{e.value.path}: {e.value.reason}'
  assert '\n' not in str(e.value)
  return e.value.reason


def test_load_reads_an_object(tmp_path):
  path = _file(tmp_path, '{"a": 1}')
  assert jsonfile.load(path) == {'a': 1}
  assert jsonfile.load(path, top=(list, dict)) == {'a': 1}
  assert jsonfile.load(_file(tmp_path, '[1]'), top=list) == [1]


def test_a_larger_file_is_refused_before_reading(tmp_path):
  path = _file(tmp_path, '[1, 2]')
  assert jsonfile.read_bytes(path, 6) == b'[1, 2]'
  assert (
    _reason(jsonfile.read_bytes, path, 5)
    == 'holds 6 bytes, more than the 5 allowed'
  )


def test_what_is_not_a_regular_file_is_named(tmp_path):
  assert _reason(jsonfile.load, str(tmp_path)) == 'is a folder'
  assert _reason(jsonfile.load, '/dev/zero') == (
    'is not a regular file (a character device)'
  )
  fifo = str(tmp_path / 'fifo')
  os.mkfifo(fifo)  # open() would wait for a writer
  assert _reason(jsonfile.load, fifo) == 'is not a regular file (a FIFO)'
  sock = socket.socket(socket.AF_UNIX)
  try:
    sock.bind(str(tmp_path / 's'))
    assert _reason(jsonfile.load, str(tmp_path / 's')) == (
      'is not a regular file (a socket)'
    )
  finally:
    sock.close()
  assert _reason(jsonfile.load, str(tmp_path / 'nope')) == (
    'cannot read it: No such file or directory'
  )


def test_content_that_is_not_json_is_named(tmp_path):
  assert _reason(jsonfile.load, _file(tmp_path, b'{"a": "\xff"}')) == (
    'not UTF-8 text (byte 0xff at offset 7)'
  )
  assert _reason(jsonfile.load, _file(tmp_path, 'nope')) == (
    'not JSON (Expecting value: line 1 column 1 (char 0))'
  )
  assert _reason(jsonfile.load, _file(tmp_path, '[' * 100_000)) == (
    'not JSON (nested too deeply)'
  )
  assert _reason(jsonfile.load, _file(tmp_path, '[1]')) == (
    'holds a list, not an object'
  )
  assert _reason(jsonfile.load, _file(tmp_path, '"x"'), top=(list, dict)) == (
    'holds the string "x", not a list or an object'
  )


def test_field_checks_presence_and_type():
  obj = {
    'n': 3,
    'b': True,
    'x': 0.5,
    's': 'abc',
    'z': None,
    'l': [1],
  }
  assert jsonfile.field(obj, 'n', int, 'm.json') == 3
  assert jsonfile.field(obj, 'n', float, 'm.json') == 3.0
  assert isinstance(jsonfile.field(obj, 'n', float, 'm.json'), float)
  assert jsonfile.field(obj, 'b', bool, 'm.json') is True
  assert jsonfile.field(obj, 'l', list, 'm.json') == [1]
  assert jsonfile.field(obj, 'missing', int, 'm.json', default=7) == 7
  assert jsonfile.field(obj, 'z', int, 'm.json', default=None) is None
  cases = [
    ('s', int, '"s" is the string "abc", not an integer'),
    ('b', int, '"b" is true, not an integer'),
    ('b', float, '"b" is true, not a number'),
    ('x', int, '"x" is the number 0.5, not an integer'),
    ('l', dict, '"l" is a list, not an object'),
    ('z', int, '"z" is null, not an integer'),
    ('missing', str, 'has no "missing" (want a string)'),
    ('n', (str, list), '"n" is the number 3, not a string or a list'),
  ]
  for key, kind, reason in cases:
    assert _reason(jsonfile.field, obj, key, kind, 'm.json') == reason
  with pytest.raises(jsonfile.JsonFileError) as e:
    jsonfile.field(obj, 's', int, 'pool/m/meta.json')
  assert str(e.value) == (
    'pool/m/meta.json: "s" is the string "abc", not an integer'
  )


def test_check_names_an_element():
  assert _reason(jsonfile.check, [2, 'x'][1], int, 'm.json', 'shape[1]') == (
    'shape[1] is the string "x", not an integer'
  )


def test_user_content_is_clipped_to_one_line(tmp_path):
  long = 'a' * 1000
  reason = _reason(jsonfile.field, {long: 'x'}, long, int, 'm.json')
  assert reason == f'"{"a" * 40}…" is the string "x", not an integer'
  with pytest.raises(jsonfile.JsonFileError) as e:
    jsonfile.load('bad\nname\x1b[31m')
  assert str(e.value) == (
    'bad\\nname\\x1b[31m: cannot read it: No such file or directory'
  )
  big = jsonfile.describe('b' * 1000)
  assert big == f'the string "{"b" * 39}…'


def test_clip_escapes_control_characters_and_cuts_long_text():
  assert errors.clip('a\nb\tc\x00\x9b') == 'a\\nb\\tc\\x00\\x9b'
  assert errors.clip('x' * 300) == 'x' * 200 + '…'
  assert errors.clip('abcdef', 3) == 'abc…'
