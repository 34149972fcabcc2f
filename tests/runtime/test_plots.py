"""The figures: what they draw, checked on the matplotlib objects."""

import json
import os
import subprocess
import sys

import numpy as np
import pytest

from fedjax_mr.runtime import plots
from tests import helpers

REPO = os.path.dirname(os.path.dirname(os.path.dirname(__file__)))
NAN = float('nan')


def rows(accs, losses, test_losses=None, cosines=None):
  """Metrics rows of rounds 1, 2, ...; None: not evaluated that round."""
  out = []
  for i, (acc, loss) in enumerate(zip(accs, losses)):
    row = {'round': i + 1, 'train_loss': loss}
    if acc is not None:
      row['test_accuracy'] = acc
      row['test_loss'] = (test_losses or losses)[i]
    if cosines is not None:
      row['pairwise_cosine'] = cosines[i]
    out.append(row)
  return out


# Seeds 0 and 1 finish; seed 2 diverges in round 3 (its row has no
# evaluation). Seed 0 has one more evaluation than seed 1.
SEEDS = {
  0: rows([0.1, 0.5, None, 0.7, 0.8], [2.0, 1.0, 0.5, 0.4, 0.3]),
  1: rows([0.3, 0.7, None, 0.9], [2.0, 1.0, 0.7, 0.6]),
  2: rows([0.2, 0.2, None], [2.0, 40.0, NAN]),
}


def test_curve_averages_finished_seeds_and_keeps_diverged_ones_apart():
  c = plots.curve(SEEDS, 'test_accuracy', 100.0)
  # Rounds both finished seeds evaluated: 1, 2, 4 (not 5).
  np.testing.assert_array_equal(c.rounds, [1, 2, 4])
  helpers.assert_close(c.mean, [20, 60, 80])
  helpers.assert_close(c.std, [10, 10, 10])
  assert c.seeds == 2
  (stop,) = c.stopped
  assert (stop.seed, stop.round) == (2, 3)
  np.testing.assert_array_equal(stop.rounds, [1, 2])
  helpers.assert_close(stop.values, [20, 20])
  # The train loss of the diverged seed ends at its last finite round.
  (stop,) = plots.curve(SEEDS, 'train_loss').stopped
  np.testing.assert_array_equal(stop.rounds, [1, 2])
  helpers.assert_close(stop.values, [2.0, 40.0])
  # Every seed diverged: no mean, every seed kept.
  c = plots.curve({5: SEEDS[2]}, 'train_loss')
  assert c.seeds == 0 and len(c.rounds) == 0 and len(c.stopped) == 1


def test_legend_label_names_seeds_and_divergence():
  assert plots.legend_label('FedAvg', {0: SEEDS[0]}) == 'FedAvg'
  assert plots.legend_label('MOON', {4: SEEDS[2]}) == (
    'MOON (diverged at round 3)'
  )
  two = {0: SEEDS[2], 1: SEEDS[0], 7: rows([0.1], [NAN])}
  label = plots.legend_label('SCAFFOLD', two).replace('\n  ', ' ')
  assert label == (
    'SCAFFOLD (3 seeds; seed 0 diverged at round 3, seed 7 at round 1)'
  )
  assert plots.legend_label('FedProx', {0: SEEDS[0], 1: SEEDS[1]}) == (
    'FedProx (2 seeds)'
  )


def _lines(ax):
  return [line for line in ax.get_lines() if len(line.get_xdata())]


def test_curves_figure_draws_percent_bands_and_diverged_marks():
  fig = plots.curves_figure(
    {'FedAvg': SEEDS, 'FedMR': {0: SEEDS[0]}}, title='the setting'
  )
  fig.canvas.draw()
  acc, test_loss, train_loss = fig.axes[:3]
  assert len([ax for ax in fig.axes if ax.get_visible()]) == 3  # no cosine
  assert acc.get_ylabel() == 'test accuracy (%)'
  assert test_loss.get_ylabel() == 'test loss (log scale)'
  assert train_loss.get_yscale() == 'log'
  # Plain numbers on the log axis, from 0.35 / 1.3 (the lowest mean) to the
  # ceiling 20 (seed 2's 40 is cut off): powers of ten and three times them.
  labels = [t.get_text() for t in train_loss.get_yticklabels()]
  assert labels == ['0.3', '1', '3', '10'], labels
  assert not [t for t in train_loss.get_yticklabels(minor=True) if t.get_text()]
  # FedAvg's mean in percent, its diverged seed dashed up to round 2 and
  # marked there with ×.
  lines = _lines(acc)
  means = [np.asarray(line.get_ydata(), float) for line in lines]
  assert any(np.allclose(m, [20, 60, 80]) for m in means)
  marks = [line for line in lines if line.get_marker() == 'x']
  assert len(marks) == 1
  assert list(marks[0].get_xdata()) == [2]
  helpers.assert_close(marks[0].get_ydata(), [20])
  assert any(line.get_linestyle() == '--' for line in lines)
  # One band (FedAvg has two finished seeds, FedMR one).
  assert len(acc.collections) == 1
  # Rounds are integers on every panel.
  for ax in fig.axes[:3]:
    ticks = [t for t in ax.get_xticks() if ax.get_xlim()[0] <= t]
    assert ticks and all(float(t).is_integer() for t in ticks), ticks
  # The legend, below every panel, names the divergence.
  (legend,) = fig.legends
  texts = [t.get_text().replace('\n  ', ' ') for t in legend.get_texts()]
  assert texts == [
    'FedAvg (3 seeds; seed 2 diverged at round 3)',
    'FedMR',
  ]
  bottom = min(ax.get_window_extent().y0 for ax in fig.axes)
  assert legend.get_window_extent().y1 <= bottom
  title = fig._suptitle.get_text()
  assert title.startswith('the setting\nmean ± 1 std over seeds')
  assert 'diverged' in title


def test_a_long_title_does_not_run_into_the_legend():
  # A compare setting's title spans most of the figure's width; a side
  # legend at the top right sat under its last words (and one centred on
  # the right floated between two rows of panels).
  long = ', '.join(['fashion_mnist cnn_mnist, dirichlet α=0.1'] * 3)
  fedmr = rows([0.5, 0.6], [1.0, 0.9], cosines=[0.9, 0.8])
  runs = {'FedAvg': SEEDS, 'FedMR': {0: fedmr}}
  fig = plots.curves_figure(runs, long)
  fig.canvas.draw()
  (legend,) = fig.legends
  box = legend.get_window_extent()
  title = fig._suptitle.get_window_extent()
  assert box.y1 <= title.y0
  # Four panels in two rows: the legend is below both, not between them.
  assert len([ax for ax in fig.axes if ax.get_visible()]) == 4
  assert box.y1 <= min(ax.get_window_extent().y0 for ax in fig.axes)
  # The K models' cosine is FedMR's alone, and its panel says so.
  assert fig.axes[3].get_title() == 'FedMR only'


def test_many_methods_are_drawn_in_rows_by_family():
  # A reference, then methods that aggregate and methods that keep K
  # models (which log the cosine): a row per group, the reference in
  # grey in each, a legend inside each row's accuracy panel.
  flat = {0: rows([0.5, 0.6], [1.0, 0.9])}
  kept = {0: rows([0.4, 0.5], [1.2, 1.1], cosines=[0.9, 0.8])}
  runs = {'FedAvg': flat, 'A': flat, 'B': flat, 'FedMR': kept}
  groups = {'aggregate': ['A', 'B'], 'keep K models': ['FedMR']}
  fig = plots.families_figure(runs, groups, 'the setting')
  fig.canvas.draw()
  visible = [ax for ax in fig.axes if ax.get_visible()]
  # Accuracy and train loss per row, the cosine only in FedMR's row.
  assert [ax.get_ylabel() for ax in visible] == [
    'test accuracy (%)',
    'train loss (log scale)',
    'test accuracy (%)',
    'train loss (log scale)',
    'mean pairwise cosine of the K models',
  ]
  assert visible[0].get_title(loc='left') == 'aggregate'
  assert visible[2].get_title(loc='left') == 'keep K models'
  assert visible[4].get_title() == 'FedMR only'
  for ax, names in [
    (visible[0], ['FedAvg', 'A', 'B']),
    (visible[2], ['FedAvg', 'FedMR']),
  ]:
    legend = ax.get_legend()
    assert [t.get_text() for t in legend.get_texts()] == names
    grey = [line for line in _lines(ax) if line.get_color() == '0.6']
    assert len(grey) == 1  # the reference
    helpers.assert_close(grey[0].get_ydata(), [50, 60])


def test_a_loss_that_explodes_is_cut_off_at_a_ceiling():
  # Seed 2's train loss reaches 40 before it diverges: more than a decade
  # above the finished curves' first value (2), so the axis stops at 20
  # and its × sits on the top edge.
  fig = plots.curves_figure({'FedAvg': SEEDS})
  train_loss = fig.axes[2]
  assert train_loss.get_ylim()[1] == pytest.approx(20.0)
  (mark,) = [line for line in _lines(train_loss) if line.get_marker() == 'x']
  helpers.assert_close(mark.get_ydata(), [20.0])
  assert 'cut off' in fig._suptitle.get_text()
  # Without it, nothing is cut.
  fig = plots.curves_figure({'FedAvg': {0: SEEDS[0]}})
  assert fig.axes[2].get_ylim()[1] < 20
  assert fig._suptitle is None  # one seed, nothing diverged or cut


def test_the_cosine_panel_appears_when_logged_and_many_legends_go_below():
  runs = {
    f'method {i}': {0: rows([0.5, 0.6], [1.0, 0.9], cosines=[0.9, 0.8])}
    for i in range(plots.MAX_SIDE_LEGEND + 1)
  }
  fig = plots.curves_figure(runs)
  fig.canvas.draw()
  assert [ax.get_ylabel() for ax in fig.axes] == [
    'test accuracy (%)',
    'test loss (log scale)',
    'train loss (log scale)',
    'mean pairwise cosine of the K models',
  ]
  helpers.assert_close(_lines(fig.axes[3])[0].get_ydata(), [0.9, 0.8])
  # Two rounds: ticks 1 and 2, not 1.0, 1.2, ..., 2.0.
  for ax in fig.axes:
    low, high = ax.get_xlim()
    assert [t for t in ax.get_xticks() if low <= t <= high] == [1, 2]
  (legend,) = fig.legends
  assert len(legend.get_texts()) == plots.MAX_SIDE_LEGEND + 1
  bottom = min(ax.get_window_extent().y0 for ax in fig.axes)
  assert legend.get_window_extent().y1 <= bottom


def test_plot_curves_and_landscape_write_pngs(tmp_path):
  path = str(tmp_path / 'curves.png')
  plots.plot_curves({'FedAvg': SEEDS}, path, title='t')
  with open(path, 'rb') as f:
    assert f.read(8) == b'\x89PNG\r\n\x1a\n'
  xs = [-1.0, 0.0, 1.0]
  grid = {
    'x': xs,
    'y': xs,
    'loss': [[3.0, 2.0, 3.0], [2.0, 0.5, 2.0], [None, 2.0, 3.0]],
    'accuracy': [[0.2, 0.5, 0.2], [0.5, 0.9, 0.5], [None, 0.5, 0.2]],
  }
  fig = plots.landscape_figure(grid, 'title')
  loss_ax, acc_ax = fig.axes[:2]
  # The model is marked at the centre of both panels.
  for ax in (loss_ax, acc_ax):
    (star,) = [line for line in ax.get_lines() if line.get_marker() == '*']
    assert list(star.get_xdata()) == [0] and list(star.get_ydata()) == [0]
  colorbars = [ax.get_ylabel() for ax in fig.axes[2:]]
  assert colorbars == ['test loss (log scale)', 'test accuracy (%)']
  path = str(tmp_path / 'landscape.png')
  plots.plot_landscape(grid, path)
  assert os.path.getsize(path) > 1000


def test_importing_and_plotting_keeps_the_matplotlib_backend(tmp_path):
  # A process that chose its backend (as a notebook does) keeps it; pyplot
  # is never imported.
  code = f"""
import sys
import matplotlib
matplotlib.use('svg')
import fedjax_mr
from fedjax_mr.analysis import compare, landscape
from fedjax_mr.pipeline import experiment
from fedjax_mr.runtime import plots
rows = {json.dumps(SEEDS[0])}
plots.plot_curves({{'FedAvg': {{0: rows}}}}, {str(tmp_path / 'a.png')!r})
grid = {{'x': [-1, 0, 1], 'y': [-1, 0, 1], 'loss': [[2, 1, 2]] * 3,
        'accuracy': [[0.1, 0.2, 0.1]] * 3}}
plots.plot_landscape(grid, {str(tmp_path / 'b.png')!r})
print(matplotlib.get_backend(), 'matplotlib.pyplot' in sys.modules)
"""
  out = subprocess.run(
    [sys.executable, '-c', code],
    cwd=REPO,
    capture_output=True,
    text=True,
    timeout=120,
  )
  assert out.returncode == 0, out.stderr[-2000:]
  assert out.stdout.split() == ['svg', 'False']
  assert (tmp_path / 'a.png').exists() and (tmp_path / 'b.png').exists()


def test_more_than_ten_methods_get_distinct_colours_dark_shades_first():
  import matplotlib

  tab20 = matplotlib.colormaps['tab20']
  colors = plots._colors(15)
  assert len(set(colors)) == 15
  # Ten dark shades, then the light partners of the first five.
  assert colors[:10] == [tab20(i) for i in range(0, 20, 2)]
  assert colors[10:] == [tab20(i) for i in range(1, 10, 2)]
  assert plots._colors(3) == [
    matplotlib.colormaps['tab10'](i) for i in range(3)
  ]


def test_log_ticks_label_four_or_more_plain_values():
  assert plots.log_ticks(0.25, 0.6) == [0.25, 0.3, 0.4, 0.5, 0.6]
  assert plots.log_ticks(0.3, 3.5) == [0.3, 0.5, 0.7, 1, 1.5, 2, 3]
  assert plots.log_ticks(0.05, 20) == [0.1, 0.3, 1, 3, 10]
  assert plots.log_ticks(0.01, 50) == [0.01, 0.1, 1, 10]
  # Under a factor of about 1.7: evenly spaced round numbers.
  assert plots.log_ticks(1.65, 2.83) == [1.75, 2, 2.25, 2.5, 2.75]


def test_one_methods_legend_is_inside_its_accuracy_panel():
  fig = plots.curves_figure({'FedAvg': {0: SEEDS[0]}}, 'the setting')
  fig.canvas.draw()
  assert not fig.legends
  legend = fig.axes[0].get_legend()
  assert [t.get_text() for t in legend.get_texts()] == ['FedAvg']
  inside = fig.axes[0].get_window_extent()
  box = legend.get_window_extent()
  assert inside.x0 <= box.x0 and box.x1 <= inside.x1
  assert inside.y0 <= box.y0 and box.y1 <= inside.y1


@pytest.mark.parametrize('methods', [1, plots.MAX_SIDE_LEGEND + 1])
def test_a_title_wider_than_the_figure_breaks_after_commas(methods):
  # The Dir(0.1) table's setting, 106 characters, was cut off at both
  # edges of a figure without a side legend (one method, or many with
  # the legend below).
  setting = (
    'Fashion-MNIST, CNN (MNIST), Dir(α = 0.1), K = 10 of 100, E = 5, '
    'B = 50, lr = 0.01, momentum = 0.9, 100 rounds'
  )
  logged = rows([0.5, 0.6], [1.0, 0.9], cosines=[0.9, 0.8])
  runs = {f'method {i}': {0: logged} for i in range(methods)}  # 2 × 2 panels
  fig = plots.curves_figure(runs, setting)
  fig.canvas.draw()
  box = fig._suptitle.get_window_extent()
  assert 0 <= box.x0 and box.x1 <= fig.bbox.width
  lines = fig._suptitle.get_text().split('\n')
  assert len(lines) == 2 and lines[0].endswith(',')
  assert ' '.join(lines) == setting
  # A title that fits is left on one line.
  fig = plots.curves_figure(runs, 'Fashion-MNIST, 20 rounds')
  assert fig._suptitle.get_text() == 'Fashion-MNIST, 20 rounds'
