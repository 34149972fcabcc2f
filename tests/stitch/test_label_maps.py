"""The bundled ImageNet-1K → dataset label maps."""

from fedjax_mr.stitch import label_maps
from fedjax_mr.stitch import torchvision_import as tvi


def test_the_cifar10_map_is_a_valid_disjoint_imagenet_map():
  m = label_maps.bundled('cifar10')
  assert tvi.check_label_map(m, 10) == m  # ids in [0, 1000), none empty
  ids = [i for entry in m for i in entry]
  assert len(ids) == len(set(ids)) == 222
  assert label_maps.bundled('cinic10') == m  # the same ten classes, in order
  assert label_maps.bundled('cifar100') is None
  assert label_maps.bundled('fashion_mnist') is None


def test_the_cifar10_map_places_known_imagenet_classes():
  airplane, automobile, bird, cat, deer, dog, frog, horse, ship, truck = (
    label_maps.bundled('cifar10')
  )
  # torchvision's class order: 404 airliner, 817 sports car, 9 ostrich,
  # 281 tabby, 352 impala, 151 Chihuahua … 268 Mexican hairless, 30
  # bullfrog, 339 sorrel, 510 container ship, 867 trailer truck.
  assert 404 in airplane and 817 in automobile and 9 in bird
  assert cat == [281, 282, 283, 284, 285] and 352 in deer
  assert dog == list(range(151, 269)) and frog == [30, 31, 32]
  assert 339 in horse and 510 in ship and 867 in truck
  # Left out on purpose: airship 405, pickup 717 (CIFAR-10 has it in no
  # class), ambulance 407, zebra 340.
  everything = set(sum(label_maps.bundled('cifar10'), []))
  assert not everything & {405, 717, 407, 340}


def test_a_bundled_map_is_a_fresh_copy():
  m = label_maps.bundled('cifar10')
  m[0].append(1)
  assert label_maps.bundled('cifar10')[0] == [404, 895, 908]
