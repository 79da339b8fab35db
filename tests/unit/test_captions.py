import json

import numpy as np
import pytest
import torch
from PIL import Image

from app.ml.data.captions import (
    WordTokenizer,
    karpathy_to_dataset,
    load_karpathy_split,
    make_pretraining_set,
    make_synthetic_federation,
    simple_preprocess,
)


def test_generator_is_seeded_and_plants_the_scenarios():
    a = make_synthetic_federation(3, n_clients=5, pairs_per_client=40, n_test=20)
    b = make_synthetic_federation(3, n_clients=5, pairs_per_client=40, n_test=20)
    assert a.clients[2].captions == b.clients[2].captions
    assert torch.equal(a.clients[2].images, b.clients[2].images)
    assert a.clients[0].images.shape == (40, 3, 32, 32)
    # star only at the forget client, purple across clients 1-3, ring for one subject of the last client
    star = [c.has_word("star").sum() for c in a.clients]
    assert star[0] == 20 and sum(star[1:]) == 0
    purple = [int(m.sum()) for m in a.forget_masks("class")]
    assert purple[0] == 0 and purple[4] == 0 and all(n > 0 for n in purple[1:4])
    samples = a.forget_masks("samples")
    assert samples[4].sum() == 8 and all(m.sum() == 0 for m in samples[:4])
    assert all("ring" in a.clients[4].captions[i] for i in np.flatnonzero(samples[4]))
    assert a.forget_masks("client")[0].all() and not a.forget_masks("client")[1].any()


def test_pretraining_set_has_no_novel_concept():
    pre = make_pretraining_set(0, 200)
    text = " ".join(pre.captions)
    assert "star" not in text and "ring" not in text and "purple" not in text


def test_tokenizer_keeps_end_of_text_largest():
    tok = WordTokenizer(context_length=12)
    ids = tok(["a small red star at the top left", "a zebra"])
    assert ids.shape == (2, 12)
    assert int(ids.argmax(dim=1)[0]) == 9  # sot + 8 words → eot at index 9 is the pooled position
    assert int(ids[0].max()) == tok.eot_id == tok.vocab_size - 1
    assert int(ids[1, 2]) == tok.unk_id


def test_karpathy_loader_on_a_fixture(tmp_path):
    images = tmp_path / "flickr30k-images"
    images.mkdir()
    entries = []
    for i, split in enumerate(["train", "test", "test", "val", "restval"]):
        name = f"{1000 + i}.jpg"
        Image.fromarray(np.full((40, 50, 3), 30 * i, dtype=np.uint8)).save(images / name)
        entries.append(
            {
                "filename": name,
                "imgid": i,
                "split": split,
                "sentids": [10 * i + j for j in range(5)],
                "sentences": [{"raw": f"Image {i} caption {j} .", "tokens": []} for j in range(5)],
            }
        )
    path = tmp_path / "dataset_flickr30k.json"
    path.write_text(json.dumps({"dataset": "flickr30k", "images": entries}))

    test = load_karpathy_split(path, images, split="test")
    assert len(test.image_paths) == 2 and len(test.captions) == 10
    assert test.ids[0] == "1-10" and test.image_index[:6] == [0, 0, 0, 0, 0, 1]
    train = load_karpathy_split(path, images, split="train", captions_per_image=2)
    assert len(train.image_paths) == 2 and len(train.captions) == 4  # restval counts as train

    ds = karpathy_to_dataset(test, simple_preprocess(32))
    assert ds.images.shape == (10, 3, 32, 32) and ds.captions[5] == "Image 2 caption 0 ."
    assert torch.equal(ds.images[0], ds.images[4]) and not torch.equal(ds.images[0], ds.images[5])


def test_membership_regime_has_a_matched_heldout_split():
    a = make_synthetic_federation(2, n_clients=4, pairs_per_client=50, n_test=20, regime="membership")
    b = make_synthetic_federation(2, n_clients=4, pairs_per_client=50, n_test=20, regime="membership")
    assert a.clients[1].captions == b.clients[1].captions and torch.equal(a.heldout.images, b.heldout.images)
    masks = a.forget_masks("membership")
    n_forget = sum(int(m.sum()) for m in masks)
    assert 0 < n_forget < 200 and len(a.heldout) == n_forget  # matched in size …
    assert all(m.any() for m in masks)  # … spread over every client (same distribution, no planted holder)
    # … and in kind: the same vocabulary, each caption with one nuisance word, no novel concept anywhere
    words = {w for d in [*a.clients, a.heldout] for c in d.captions for w in c.split()}
    assert not words & {"star", "ring", "purple"}
    from app.ml.data.captions import TAGS

    for d in (a.clients[0], a.heldout):
        assert all(sum(w in TAGS for w in c.split()) == 1 for c in d.captions)
    # every caption fits the tiny text tower's context with its end-of-text token
    ids = WordTokenizer(context_length=12)(a.heldout.captions)
    assert (ids == WordTokenizer(context_length=12).eot_id).sum(dim=1).eq(1).all()
    assert make_synthetic_federation(2, n_clients=4, pairs_per_client=50, n_test=20).heldout is None


def test_a_real_federation_from_a_karpathy_file_and_a_client_assignment(tmp_path):
    from app.ml.data.captions import load_caption_federation, read_client_assignment

    images = tmp_path / "images"
    images.mkdir()
    entries = []
    for i, split in enumerate(["train", "train", "restval", "train", "test"]):
        name = f"{i}.jpg"
        Image.fromarray(np.full((20, 20, 3), 40 * i, dtype=np.uint8)).save(images / name)
        entries.append(
            {"filename": name, "imgid": i, "split": split, "sentences": [{"raw": f"p{i} s{j}"} for j in range(3)]}
        )
    path = tmp_path / "captions.json"
    path.write_text(json.dumps({"images": entries}))
    (tmp_path / "assign.csv").write_text("image,client\n0,hospital-b\n1.jpg,hospital-a\n2,hospital-b\n")
    assignment = read_client_assignment(tmp_path / "assign.csv")
    fed, names = load_caption_federation(path, images, assignment, simple_preprocess(16))
    assert names == ["hospital-a", "hospital-b"]
    assert [len(c) for c in fed.clients] == [3, 6]  # image 3 has no client and is left out
    assert fed.clients[1].subjects[:3] == ["0.jpg"] * 3 and fed.clients[0].captions[0] == "p1 s0"
    assert len(fed.test) == 3 and fed.clients[0].images.shape == (3, 3, 16, 16)
    (tmp_path / "assign.json").write_text(json.dumps({"4": "x"}))
    with pytest.raises(ValueError):
        load_caption_federation(path, images, read_client_assignment(tmp_path / "assign.json"), simple_preprocess(16))


def test_caption_images_are_resolved_again_and_digested_where_they_are_read(tmp_path):
    """Issue 22, LOW (time-of-check/time-of-use): the worker resolves each image again (a link swapped in after the
    registration's check cannot lead out of image_root) and digests the very bytes it decodes, so a job can refuse
    images changed since version 1 (app/jobs/federated.check_images)."""
    from app.ml.data.captions import export_karpathy, load_caption_federation, read_client_assignment

    fed = make_synthetic_federation(0, n_clients=3, pairs_per_client=4, n_test=4)
    paths = export_karpathy(fed, tmp_path / "fed", client_names=["a", "b", "c"])

    def load():
        assignment = read_client_assignment(paths["assignment_path"])
        fed, _ = load_caption_federation(paths["captions_path"], paths["image_root"], assignment, simple_preprocess(16))
        return fed

    first, again = load(), load()
    assert first.source_sha256 is not None and first.source_sha256 == again.source_sha256
    victim = sorted(paths["image_root"].iterdir())[0]
    Image.new("RGB", (8, 8), (255, 0, 0)).save(victim)  # one image's pixels changed
    assert load().source_sha256 != first.source_sha256

    outside = tmp_path / "secret.png"
    Image.new("RGB", (8, 8), (0, 0, 255)).save(outside)
    victim.unlink()
    victim.symlink_to(outside)  # swapped for a link leading out of the image folder after registration
    with pytest.raises(ValueError, match="leads out of image_root"):
        load()
