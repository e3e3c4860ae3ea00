"""The load benchmark's tables and closing lines, as printed (the JSON holds every figure)."""

from __future__ import annotations


def _ms(x: float | None) -> str:
    return "-" if x is None else f"{x * 1000:.0f}"


def print_table(levels: list[dict]) -> None:
    head = (f"{'N':>3} {'done':>5} {'turns':>7} {'frames out':>10} {'frames in':>9} {'late':>5} "
            f"{'v2v p50':>8} {'v2v p95':>8} {'caller p95':>10} {'peak RSS':>9} {'mixed':>5} {'extra':>8} held")
    print(head)
    print("-" * len(head))
    for lv in levels:
        extra = ",".join(str(x) for x in lv["extra_refused"]) or "-"
        print(f"{lv['calls']:>3} {lv['completed']:>2}/{lv['calls']:<2} {lv['turns_answered']:>3}/{lv['turns']:<3} "
              f"{lv['frames_sent_by_callers']:>10} {lv['frames_received_by_callers']:>9} {lv['late_frames']:>5} "
              f"{_ms(lv['v2v_p50_s']):>8} {_ms(lv['v2v_p95_s']):>8} {_ms(lv['v2v_caller_p95_s']):>10} "
              f"{lv['peak_rss_mb']:>7.0f}MB {lv['mixed']:>5} {extra:>8} {'yes' if lv.get('held') else 'no'}")
    print("(v2v in ms: server report p50/p95, caller side p95; late = outbound gaps > 40 ms; "
          "extra = HTTP status of the callers over the limit)")
    print("\nwhere voice-to-voice went, p50 ms of each span (per turn the spans add up to voice-to-voice):")
    for lv in levels:
        parts = lv.get("v2v_parts_p50_s") or {}
        print(f"{lv['calls']:>3}  " + "  ".join(f"{name} {_ms(value)}" for name, value in parts.items()))
    waits = [lv for lv in levels if lv.get("engine")]
    if waits:
        print("\nan ended turn's LLM behind background work (a pass of preemptive work alone, already running):")
        for lv in waits:
            e = lv["engine"]
            print(f"{lv['calls']:>3}  {e['behind_background']} passes waited, {e['behind_background_s'] * 1000:.0f} ms "
                  f"in all; {e['passes']} passes, {e['deferred']} background passes deferred")


def print_levels(result: dict) -> None:
    print()
    print_table(result["levels"])
    held = result["largest_n_held"]
    print(f"\nlargest N held (all complete, none mixed, extra refused 503, p95 v2v <= 2x single call): {held}")


def print_soak_round(rounds: int, lv: dict, sample: tuple[float, float, int, int], heap: dict[str, float]) -> None:
    malloc = (f", malloc in use {heap['malloc_in_use_mb']:.0f} of {heap['malloc_held_mb']:.0f} MB"
              if "malloc_held_mb" in heap else "")
    print(f"  soak round {rounds}: {lv['completed']}/{lv['calls']} complete, "
          f"v2v p95 {_ms(lv['v2v_p95_s'])} ms, RSS {sample[1]:.0f} MB{malloc}, "
          f"objects {heap['gc_objects']}, fds {sample[2]}, threads {sample[3]}", flush=True)


def print_soak(s: dict) -> None:
    print(f"\nsoak {s['seconds']:.0f} s: {s['completed']}/{s['calls']} calls complete, "
          f"{s['turns_answered']}/{s['turns']} turns, mixed {s['mixed']}, reports lost {s['reports_lost']}")
    slope = s["rss_slope_mb_per_min"]
    half = s["rss_slope_second_half_mb_per_min"]
    print(f"RSS slope {slope if slope is None else round(slope, 3)} MB/min, second half "
          f"{half if half is None else round(half, 3)} MB/min (first/last {s['rss_mb_first_last']} MB); "
          f"fds first/last/max {s['fds_first_last_max']}; threads first/last/max {s['threads_first_last_max']}")


def print_bridge_table(levels: list[dict], stop: dict | None) -> None:
    for i, lv in enumerate(levels):
        lost = "-" if lv["lost"] is None else lv["lost"]
        print(f"round {i + 1}: {lv['calls']} calls: {lv['completed']} completed, {lv['cut']} cut by a stopped bridge "
              f"(report end_reason {lv['cut_end_reasons'] or '-'}), {lv['refused']} refused everywhere, "
              f"{lv['failed']} failed; reports lost {lost}, duplicated {lv['reports_duplicated']}, "
              f"in another bridge's folder {lv['reports_wrong_bridge']}; mixed {lv['mixed']}; "
              f"caller v2v p50/p95 {_ms(lv['v2v_caller_p50_s'])}/{_ms(lv['v2v_caller_p95_s'])} ms, "
              f"server {_ms(lv['v2v_p50_s'])}/{_ms(lv['v2v_p95_s'])} ms")
        for b, s in enumerate(lv["bridges"]):
            print(f"    bridge {b}: placed {s['placed']}, completed {s['completed']}, cut {s['cut']}, "
                  f"refused {s['refused']}, connect failed {s['connect_failed']}")
        if "after_stop" in lv and lv["after_stop"]["attempts_on_stopped"] + len(lv["after_stop"]["placed_on"]):
            a = lv["after_stop"]
            print(f"    after the stop: placed on bridges {a['placed_on']}; {a['attempts_on_stopped']} attempt(s) "
                  f"on the stopped bridge, {a['placed_on_stopped']} connected")
    if stop is not None:
        print(f"stop: bridge {stop['bridge']} got {stop['signal']} at {stop['t']:.1f} s with "
              f"{len(stop['in_flight'])} call(s) in flight; exit code {stop.get('exit_code')}")


def print_bridge_totals(out: dict, reports_checked: bool) -> None:
    print()
    print_bridge_table(out["rounds"], out["stop"])
    t = out["totals"]
    lost = t["reports_missing"] + t["reports_without_end"] if reports_checked else "not checked"
    print(f"\ntotal: {t['calls']} calls, {t['connected']} connected, {t['completed']} completed, {t['cut']} cut, "
          f"{t['refused']} refused everywhere; reports lost {lost}, "
          f"mixed {t['mixed']}; serve exit codes {out['exit_codes'] or '-'}")
