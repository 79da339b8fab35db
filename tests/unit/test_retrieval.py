import torch

from app.ml.verification.retrieval import recall_at_k, retrieval_scores


def _unit(x: torch.Tensor) -> torch.Tensor:
    return x / x.norm(dim=1, keepdim=True)


def test_perfect_alignment_gives_full_recall():
    emb = _unit(torch.eye(6))
    s = retrieval_scores(emb, emb, [f"caption {i}" for i in range(6)])
    assert s.i2t_r1 == s.t2i_r1 == 1.0 and s.mean_r1 == 100.0


def test_duplicate_captions_count_as_correct():
    # images 0 and 1 share a caption; image 0's embedding is closest to text 1 — still a correct retrieval
    img = _unit(torch.tensor([[1.0, 0.1, 0], [1.0, 0.0, 0], [0, 0, 1.0]]))
    txt = _unit(torch.tensor([[0.0, 1.0, 0], [1.0, 0.05, 0], [0, 0, 1.0]]))
    s = retrieval_scores(img, txt, ["a red star", "a red star", "a blue ring"])
    assert s.i2t_r1 == 1.0
    s2 = retrieval_scores(img, txt, ["a red star", "a red circle", "a blue ring"])
    assert s2.i2t_r1 < 1.0


def test_distractors_enlarge_the_gallery_and_can_only_lower_recall():
    torch.manual_seed(0)
    img, txt = _unit(torch.randn(20, 8)), _unit(torch.randn(20, 8))
    caps = [f"c{i % 7}" for i in range(20)]
    base = retrieval_scores(img, txt, caps)
    dimg, dtxt = _unit(torch.randn(30, 8)), _unit(torch.randn(30, 8))
    with_d = retrieval_scores(img, txt, caps, dimg, dtxt, [f"d{i}" for i in range(30)])
    assert with_d.gallery_size == 50 and with_d.n_queries == 20
    assert with_d.i2t_r1 <= base.i2t_r1 and with_d.t2i_r1 <= base.t2i_r1


def test_recall_at_k_monotone():
    torch.manual_seed(1)
    q, g = _unit(torch.randn(40, 4)), _unit(torch.randn(40, 4))
    labels = torch.arange(40)
    r = recall_at_k(q, g, labels, labels, ks=(1, 5, 40))
    assert r[1] <= r[5] <= r[40] == 1.0
