"""The documentation site builds in strict mode, as BUILD.md says: a
broken link or anchor, a missing cross-reference or a docstring that does
not render fails the build, and the API reference has a page for every
public module of the package, found by walking it."""

import os
import re
import subprocess
import sys

import yaml

from tests import docs_text

REPO = docs_text.REPO
# Material's banner about MkDocs 2 goes to the log; it is not a warning of
# this site.
ENV = {
  **os.environ,
  'NO_MKDOCS_2_WARNING': '1',
  'DISABLE_MKDOCS_2_WARNING': 'true',
}


def _build(config, site):
  return subprocess.run(
    [sys.executable, '-m', 'mkdocs', 'build', '--strict']
    + ['--config-file', str(config), '--site-dir', str(site)],
    cwd=REPO,
    env=ENV,
    capture_output=True,
    text=True,
    timeout=600,
  )


def _public_modules():
  import importlib.util

  spec = importlib.util.spec_from_file_location(
    'gen_api', os.path.join(REPO, 'docs', 'gen_api.py')
  )
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)  # only defines: mkdocs runs main()
  return module.public_modules()


def test_the_site_builds_in_strict_mode(tmp_path):
  site = tmp_path / 'site'
  proc = _build(os.path.join(REPO, 'mkdocs.yml'), site)
  assert proc.returncode == 0, proc.stdout + proc.stderr
  # MkDocs' own warnings (`WARNING -  ...`), which strict mode counts.
  assert not re.search(r'^WARNING\s+-', proc.stderr, re.M), proc.stderr
  for page in ['quickstart', 'howto/add-algorithm', 'results/fashion-mnist']:
    assert (site / page / 'index.html').is_file(), page
  # A page per public module, with its docstring rendered.
  modules = _public_modules()
  assert 'fedjax_mr.algorithms.fedmr' in modules
  assert 'fedjax_mr.core.types' in modules
  for name in modules:
    html = site / 'reference' / name.replace('.', '/') / 'index.html'
    assert html.is_file(), name
    assert f'id="{name}"' in html.read_text(), name
  index = (site / 'reference' / 'index.html').read_text()
  assert all(f'<code>{name}</code>' in index for name in modules)
  # Offline: no web fonts, no fetched assets.
  home = (site / 'index.html').read_text()
  assert 'fonts.googleapis.com' not in home and 'fonts.gstatic' not in home


def test_a_broken_link_or_anchor_fails_the_build(tmp_path):
  # The site's own validation settings, on a page of two bad links.
  with open(os.path.join(REPO, 'mkdocs.yml')) as f:
    config = yaml.safe_load(f)
  docs = tmp_path / 'docs'
  docs.mkdir()
  (docs / 'index.md').write_text('# Home\n\n## Here\n\n[a](#here)\n')
  (docs / 'other.md').write_text('[b](missing.md) and [c](index.md#nowhere)\n')
  config.update(
    docs_dir=str(docs),
    nav=['index.md', 'other.md'],
    plugins=['search'],
  )
  path = tmp_path / 'mkdocs.yml'
  path.write_text(yaml.safe_dump(config))
  proc = _build(path, tmp_path / 'site')
  assert proc.returncode != 0
  assert "contains a link 'missing.md'" in proc.stderr, proc.stderr
  assert "does not contain an anchor '#nowhere'" in proc.stderr, proc.stderr
