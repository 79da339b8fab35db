"""bench.tabular's README table: a method with no end-to-end figure says why (the problem the service answered), and
`auto` says where it was not asked through the service, instead of an unexplained dash."""

from bench.tabular import METHODS, e2e_summary, markdown_table


def _run(status, e2e_s=None, ran=None, problem=None) -> dict:
    return {"status": status, "e2e_s": e2e_s, "ran": ran} | ({"problem": problem} if problem else {})


def test_e2e_cells_name_the_refusal_and_what_was_not_asked():
    service = {"e2e": {"1": {
        "retrain": [_run("certified", 10.0, "retrain")],
        "newton": [_run(409, problem="method-refused")],
        "auto": [_run("certified", 12.5, "retrain")],
    }}}  # fmt: skip
    e2e = e2e_summary(service, "1")
    assert e2e["auto"]["speedup_e2e"] == 0.8 and e2e["newton"]["not_completed"] == ["method-refused"]
    assert e2e["influence"]["asked"] == 0

    def entry(m, k):
        e = {"param_ratio": 0.5, "speedup": 100.0, "time_s": 1.0, "acc_gap_pts": 0.0, "speedup_e2e": None}
        if k == "1" and m in e2e:
            e |= {"speedup_e2e": e2e[m]["speedup_e2e"], "e2e_asked": e2e[m]["asked"]}
            e["e2e_not_completed"] = e2e[m]["not_completed"]
        return e

    summary = {}
    for k in ("1", "100"):
        summary[f"toy_mlp_{k}"] = {m: entry(m, k) for m in METHODS}
        summary[f"toy_mlp_{k}"]["auto"] = {
            "ran": e2e["auto"]["ran"] if k == "1" else [],
            "speedup_e2e": e2e["auto"]["speedup_e2e"] if k == "1" else None,
            "e2e_asked": e2e["auto"]["asked"] if k == "1" else 0,
        }
    rows = {line.split(" | ")[1]: line for line in markdown_table({"summary": summary}).splitlines()[2:]}
    assert "0.5 · 100× · method-refused · +0.00 | 0.5 · 100× · — · +0.00" in rows["newton"]
    assert "0.5 · 100× · — · +0.00" in rows["influence"]  # not asked: a dash, no problem name
    assert "→ retrain · e2e 0.80× | not run through the service" in rows["auto"]
