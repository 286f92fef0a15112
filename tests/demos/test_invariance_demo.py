from geosharp.demos.invariance import invariance_table, main


def test_demo_geodesic_rise_is_invariant_and_adaptive_is_not(capsys):
    ref, rows = invariance_table(seed=1)
    for _, res in rows:
        for kind in ("geodesic-inv-o1", "geodesic-inv-o2", "geodesic-mix-o2"):
            # float64 roundoff through solves with cond(A) up to ~1e3: 1e-9 relative is generous.
            assert abs(res[kind][0] - ref[kind][0]) <= 1e-9 * abs(ref[kind][0])
    changes = [abs(res["adaptive"][0] / ref["adaptive"][0] - 1) for _, res in rows]
    assert max(changes) > 0.05
    main()
    assert "geodesic-mix-o2" in capsys.readouterr().out
