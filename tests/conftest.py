"""Environment for the whole suite, set before jax is imported: float64 is enabled so
decode-vs-forward comparisons are tight and near-ties cannot flip a top-k; presets that need
float32 say so. Shared helpers live in tests/helpers.py."""

import os
import re

# The tests check numbers, not speed, and compiling is half of this suite's time (in the fast
# tier 454 of 899 s of tests' wall time, 4,613 XLA:CPU compiles; jax.monitoring's durations).
# So: LLVM at -O0 (~30% faster compiles); XLA:CPU's older elemental emitters, not its MLIR
# fusion emitters, and one LLVM module per program, not split for threads that two workers on
# two cores cannot use (the fast tier 486 s -> 336 s, user CPU 14m39s -> 9m59s; the emitters
# alone 366 s); both tiers pass under them. (Scripts the tests start inherit them.)
os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=1 "
                                   "--xla_backend_optimization_level=0 "
                                   "--xla_cpu_use_fusion_emitters=false "
                                   "--xla_cpu_parallel_codegen_split_count=1")
# No persistent compilation cache: on a fresh clone it saved nothing measurable (the fast
# tier took 9:30 without it, 10:00 with it), and a CI run with it lost an xdist worker to a
# crash no rerun reproduced; loading XLA:CPU executables from disk is where jax's issues
# report such crashes.

import gc  # noqa: E402

import jax  # noqa: E402
import pytest  # noqa: E402

jax.config.update("jax_enable_x64", True)

# XLA:CPU maps memory for every compiled program (a few regions each, more for large ones)
# and keeps it while jax's caches hold the program. A worker that compiles thousands of
# programs reaches the kernel's vm.max_map_count (65,530 regions) and its next compile
# segfaults: that took down a full-tier worker twice. Past this many regions, a test's
# teardown drops jax's caches (what is needed again compiles again; dropping them takes ~6 s).
# The fast tier stays under the limit; 25,000 regions of headroom is ~1,500 programs in a test.
MAPS_LIMIT = int(os.environ.get("DSATTN_TEST_MAPS_LIMIT", "40000"))


def _memory_map_regions() -> int:
    try:
        with open("/proc/self/maps", "rb") as f:
            return sum(1 for _ in f)
    except OSError:  # no /proc: not Linux
        return 0


@pytest.hookimpl(trylast=True)
def pytest_runtest_teardown(item, nextitem):
    if _memory_map_regions() > MAPS_LIMIT:
        jax.clear_caches()
        gc.collect()


# --- Tiers. `make test` runs `-m "not full"` (the fast tier); `make test-all` everything.
# Whole tests and modules mark themselves with @pytest.mark.full where they are written
# (the 8-device sharding checks, the property searches, the benchmarks); the parameter cases
# and tests below move to the full tier from here, each with the fast-tier test that keeps
# its promise covered. A node id names one case ("...[v4]") or every case of a test.
FULL = {
    "tests/test_prefix_cache.py::test_shared_prefixes_cut_anywhere_equal_their_outputs_with_the_cache_off":
        "test_serve_api's cached-tokens case reuses prefixes (greedy and sampled, MHA) and "
        "equals solo generate",
    "tests/test_serve_bench.py::test_a_shared_prefix_is_reused_and_held_once":
        "test_prefix_cache's fast case keeps reuse equal to serving with the cache off; "
        "test_serve_api's cached-tokens case counts the hit",
    "tests/test_serve_isolation.py::test_prompts_prefilling_beside_decoding_rows_equal_their_solo_outputs[v4]":
        "[mha] stays; test_each_request_equals_its_solo_generate[v4] prefills V4 rows beside "
        "decoding ones",
    "tests/test_hadamard.py::test_float64_forward_is_unchanged_by_the_rotation[dsa]":
        "[v4], [v41] stay",
    "tests/test_hadamard.py::test_rotated_fp4_keys_decode_equals_the_fake_quant_forward[dsa]":
        "test_v4's quantized-cache case keeps DSA's FP4 keys (rotated)",
    "tests/test_length_controls.py::test_scaled_top_k_keeps_the_parameters":
        "the noise-probe test stays",
    # cheaper cases of the same test stay fast; each family's causality: test_properties
    "tests/test_blocks.py::test_training_step_memory_grows_linearly_with_the_sequence[v4-extra0]":
        "[mha-extra1] stays",
    "tests/test_blocks.py::test_dense_warmup_reads_every_complete_entry_by_blocks":
        "block-size independence: test_loss_and_gradients_do_not_depend_on_block_sizes",
    "tests/test_blocks.py::test_loss_and_gradients_do_not_depend_on_block_sizes[v4-extra0]":
        "[mha] stays",
    "tests/test_blocks.py::test_loss_and_gradients_do_not_depend_on_block_sizes[v41-extra1]":
        "[mha] stays",
    "tests/test_blocks.py::test_loss_and_gradients_do_not_depend_on_block_sizes[dsa-extra2]":
        "[mha] stays",
    "tests/test_blocks.py::test_causal_segments_equal_one_segment[csa_warmup]": "[mha] stays",
    "tests/test_blocks.py::test_causal_segments_equal_one_segment[v41]": "[mha] stays",
    "tests/test_blocks.py::test_causal_segments_equal_one_segment[csa]": "[mha] stays",
    "tests/test_blocks.py::test_causal_segments_equal_one_segment[hca]": "[mha] stays",
    "tests/test_blocks.py::test_causal_segments_equal_one_segment[mla]": "[mha] stays",
    "tests/test_blocks.py::test_causal_segments_equal_one_segment[dsa]": "[mha] stays",
    "tests/test_blocks.py::test_causal_segments_equal_one_segment[gqa]": "[mha] stays",
    "tests/test_blocks.py::test_long_sequences_rematerialise_whole_blocks[False]": "[True] stays",
    "tests/test_blocks.py::test_v4_layer_by_blocks_equals_the_dense_path":
        "test_loss_and_gradients_do_not_depend_on_block_sizes",
    # scanned stacks: the dsa pattern and mla/mha in-place decode stay
    "tests/test_scan.py::test_nested_runs_train_as_unrolled": "scanned training: test_rundir",
    "tests/test_scan.py::test_nested_runs_equal_unrolled_and_decode_their_forward":
        "test_scanned_stack_equals_unrolled_and_decodes_its_forward[dsa]",
    "tests/test_scan.py::test_scanned_stack_equals_unrolled_and_decodes_its_forward[v41_ratios]":
        "[dsa] stays",
    "tests/test_scan.py::test_scanned_decode_updates_the_stacked_caches_in_place[v4]":
        "[mla], [mha] stay",
    # longer training: tests/test_train.py::test_every_family_lowers_the_training_loss
    "tests/test_v4.py::test_v4_training_lowers_both_losses": "every family's training, fast",
    "tests/test_v41.py::test_v41_training_lowers_loss": "every family's training, fast",
    "tests/test_train.py::test_every_family_lowers_the_training_loss[dsa]":
        "[mha], [v4], [v41] stay (their compressed layers train through the same top-k picks)",
    "tests/test_train.py::test_every_family_lowers_the_training_loss[mla]": "[mha] stays",
    "tests/test_train.py::test_every_family_lowers_the_training_loss[v41]":
        "[mha], [gqa], [v4] stay (V4.1's layers read through V4's reads and indexer)",
    "tests/test_train.py::test_seeds_trained_as_one_vmapped_model_equal_runs_trained_alone":
        "SeedGroup: test_a_nan_in_one_seed_stops_the_group_naming_that_seed stays",
    # V4.1 ablations' decode: test_properties' fast cases and [no-ced] stay
    "tests/test_v41.py::test_prefill_decode_equals_forward[no-sharing]": "[no-ced] stays",
    "tests/test_v41.py::test_prefill_decode_equals_forward[no-pool]": "[no-ced] stays",
    # accounting against XLA and interpreted kernels at the larger families
    "tests/test_flops.py::test_training_flops_match_xla[16-v41]": "the other families stay",
    "tests/test_flops.py::test_training_flops_match_xla[512-v41]": "the other families stay",
    "tests/test_flops.py::test_training_flops_match_xla[512-v4]": "the other families stay",
    "tests/test_precision.py::test_decode_equals_forward_under_bf16_compute[v41]":
        "the other families stay",
    "tests/test_precision.py::test_decode_equals_forward_under_bf16_compute[v4]":
        "the other families stay",
    "tests/test_indexer_impl.py::test_pallas_interpret_decode_equals_xla[v4-pallas_tpu]":
        "[dsa-*] stay",
    "tests/test_indexer_impl.py::test_pallas_interpret_decode_equals_xla[v41-pallas_tpu]":
        "[dsa-*] stay",
    "tests/test_indexer_impl.py::test_pallas_interpret_decode_equals_xla[v41-pallas_gpu]":
        "[dsa-*] stay",
    "tests/test_indexer_impl.py::test_pallas_interpret_decode_equals_xla[v4-pallas_gpu]":
        "[dsa-*] stay",
    # hand-picked decode cases the fast property cases cover (tests/test_properties.py draws
    # ragged prompts, chunked prefill, replay and many completed spans for every family)
    "tests/test_v4.py::test_prefill_decode_equals_forward": "test_properties, fast cases",
    "tests/test_v4.py::test_v4_chunked_prefill_equals_forward":
        "test_decode.py::test_chunked_prefill_equals_one_prefill, test_properties' chunks",
    "tests/test_v4.py::test_quantized_cache_decode_equals_fake_quant_forward[v4-formats0]":
        "[mla], [mha] formats stay",
    "tests/test_v4.py::test_quantized_cache_decode_equals_fake_quant_forward[dsa-formats1]":
        "[mla], [mha] formats and test_hadamard's FP4 index keys (decode == fake-quant) stay",
    "tests/test_v41.py::test_prefill_decode_equals_forward[no-ced]": "test_properties[v41]",
    "tests/test_v41.py::test_replay_covering_the_prompt_equals_exact_prefill":
        "test_decode.py::test_prefill_in_chunks_equals_one_chunk (replay) stays",
    "tests/test_v41.py::test_replay_report_script_runs":
        "a report script; its error line: test_scripts.py::test_user_errors_are_one_line",
    "tests/test_recall.py::test_recall_through_the_cache_equals_the_forward_in_float64":
        "test_model_predictions_align_with_the_forward stays",
    # memory analyses of remat and blocks
    "tests/test_blocks.py::test_training_step_memory_grows_linearly_with_the_sequence":
        "a memory analysis",
    "tests/test_blocks.py::test_long_sequences_rematerialise_whole_blocks": "a memory analysis",
    "tests/test_blocks.py::test_remat_frees_each_unrolled_blocks_internals": "a memory analysis",
    "tests/test_blocks.py::test_remat_recomputes_the_ffn_a_block_of_tokens_at_a_time":
        "a memory analysis",
    "tests/test_blocks.py::test_online_softmax_over_entry_blocks_equals_one_softmax[1]":
        "[64] stays",
    "tests/test_blocks.py::test_online_softmax_over_entry_blocks_equals_one_softmax[4]":
        "[64] stays",
    "tests/test_accum.py::test_accumulated_step_equals_the_whole_batch_step[v4-indexer-2]":
        "the MHA cases stay",
    "tests/test_accum.py::test_accumulation_holds_a_micro_batchs_temporaries":
        "a memory analysis",
    "tests/test_accum.py::test_resume_with_another_grad_accum_continues_exactly":
        "resume: tests/test_train.py::test_resume_equals_never_stopping",
    "tests/test_flops.py::test_length_dependent_flops_match_xla[v41]": "the other families stay",
    "tests/test_flops.py::test_length_dependent_flops_match_xla[v4]": "the other families stay",
    "tests/test_flops.py::test_training_flops_match_xla[16-v4]": "the other families stay",
    "tests/test_indexer_impl.py::test_pallas_interpret_decode_equals_xla[dsa-pallas_tpu]":
        "[dsa-pallas_gpu] stays",
    "re:tests/test_kernels.py::test_paged_scores_kernel_matches_reference\\[\\w+-3-":
        "the T=1 cases stay",
    "tests/test_precision.py::test_precision_parity_bench_trains_both_dtypes_on_the_same_"
    "batches": "a benchmark",
    "tests/test_rundir.py::test_scanned_run_saved_before_nested_runs_loads_and_resumes":
        "test_runs_restore_across_scanned_and_unrolled_layouts stays",
    "tests/test_rundir.py::test_run_saved_before_the_layer_plan_loads_and_resumes":
        "an older layout; today's resume stays",
    "tests/test_rundir.py::test_failed_async_commit_names_step_cause_and_last_checkpoint_and_a_"
    "rerun_resumes": "test_failed_save_call_is_a_write_error_and_bugs_keep_theirs stays",
    "tests/test_scripts.py::test_lower_reports_each_program_with_its_cache":
        "a report script (tests/test_lower.py stays)",
    "tests/test_device_check.py::test_device_check_records_a_spent_budget_and_a_broken_section":
        "a device report",
    "tests/test_decode.py::test_prefill_in_chunks_equals_one_chunk":
        "test_decode.py::test_chunked_prefill_equals_one_prefill, test_properties' chunks",
    "tests/test_v41.py::test_pool_covering_all_blocks_equals_flat_indexer":
        "test_newest_block_is_always_in_the_pool, test_pool_selection_breaks_ties_... stay",
    "tests/test_v41.py::test_replay_evaluation_count":
        "tests/test_engine.py::test_replay_prefill_evaluation_count stays",
    "tests/test_rundir.py::test_second_writer_refused_dead_writers_lock_taken_over_metrics_cut_"
    "to_checkpoint": "a run directory's lock (a second writer): the full tier's",
    "tests/test_accum.py::test_accumulated_step_equals_the_whole_batch_step[mha-weights-4]":
        "the full tier's [mha-weights-2] and [v4-indexer-2]",
    "tests/test_accum.py::test_accumulated_step_equals_the_whole_batch_step[mha-weights-2]":
        "the full tier's (the fast tier keeps test_grad_accum_is_validated)",
    "tests/test_bench.py::test_synthetic_context_matches_real_prefill_structure": "a benchmark's",
    "tests/test_precision.py::test_decode_equals_forward_under_bf16_compute[dsa]":
        "[mha], [mla] stay",
    "tests/test_precision.py::test_decode_equals_forward_under_bf16_compute[gqa]":
        "[mha], [mla] stay",
    "tests/test_precision.py::test_run_saved_before_param_dtype_with_bf16_restores_as_saved":
        "an older run's layout",
    "re:tests/test_precision.py::test_accelerator_training_matmuls_run_in_bfloat16\\[v41-":
        "the other families stay",
    "tests/test_precision.py::test_bf16_compute_halves_what_the_backward_pass_keeps[v41]":
        "the other families stay",
    "re:tests/test_kernels.py::test_paged_scores_kernel_matches_reference\\[gpu-1-":
        "the tpu-1 cases stay (the same reference)",
    "re:tests/test_flops.py::test_training_flops_match_xla\\[512-": "the 16-token cases stay",
    # sweeps and device reports (make test-all)
    "tests/test_scripts.py::test_recall_curve_trains_a_sweep_row": "a sweep",
    "tests/test_ablate.py::test_toy_sweep_runs_resumes_and_reports": "a sweep",
    "tests/test_ablate.py::test_mqar_sweep_evaluates_past_its_training_length": "a sweep",
    "tests/test_device_check.py::test_device_check_reports_every_section":
        "a device report; its error handling stays",
    # run-directory compatibility with older layouts; today's resume stays
    "tests/test_rundir.py::test_scanned_run_saved_with_first_copies_unrolled_loads_and_resumes":
        "test_runs_restore_across_scanned_and_unrolled_layouts stays",
    # room for the kernel, decode and serving tests (the fast tier's slowest cases, timed on
    # a fresh clone), each beside the fast case that keeps its promise
    "tests/test_yarn.py::test_decode_equals_forward_with_yarn[v4]": "[mla] stays",
    "tests/test_scripts.py::test_damaged_checkpoint_warns_in_one_line_and_the_one_before_is_used":
        "test_rundir.py::test_damaged_latest_checkpoint_falls_back_to_the_one_before stays",
    "tests/test_scan.py::test_a_copys_view_of_stacked_caches_is_that_copys_cache[False]":
        "the jitted [True] case (full tier too)",
    "tests/test_hadamard.py::test_rotated_fp4_keys_decode_equals_the_fake_quant_forward[v41]":
        "test_v4's quantized-cache case keeps DSA's FP4 keys (rotated)",
    # the fast tier within 7 minutes on a fresh clone (9:30 before these moves)
    "tests/test_readme.py::test_python_block_runs_as_written[README.md#0]":
        "a trained run's block; README.md#1 (the library's API) stays, and test_scripts "
        "generates and evaluates from a run",
    "tests/test_readme.py::test_python_block_runs_as_written[docs/design.md#0]":
        "the API of README.md#1 on V4.1; test_properties[v41] stays",
    "tests/test_device_check.py::test_tests_that_time_out_say_how_far_they_got":
        "a device report",
    "tests/test_yarn.py::test_v4_yarn_changes_only_the_compressed_layers":
        "test_decode_equals_forward_with_yarn[dsa], [mla] stay",
    "tests/test_scripts.py::test_generate_takes_layout_and_execution_overrides":
        "test_rundir.py::test_runs_restore_across_scanned_and_unrolled_layouts stays",
    "tests/test_precision.py::test_largest_batch_is_the_largest_that_fits": "a benchmark's",
    "tests/test_sharding.py::test_small_mesh_forward_matches_one_device":
        "the 8-device checks (the full tier) cover every family's sharded forward",
    "tests/test_sharding.py::test_small_mesh_train_step_matches_one_device":
        "test_sharded_train_step_matches_one_device (8 devices)",
    "tests/test_sharding.py::test_small_mesh_prefill_and_decode_match_one_device":
        "test_sharded_prefill_and_decode_match_one_device (8 devices)",
    "re:tests/test_kernels.py::test_paged_scores_kernel_matches_reference\\[tpu-1-(fp8_|native)":
        "[tpu-1-fp4_ue8m0], [tpu-1-bf16] stay",
    "tests/test_v4.py::test_quantized_cache_decode_equals_fake_quant_forward[mla-formats2]":
        "[dsa-formats1] stays: DSA's latent cache is MLA's, in the same fp8_ds_mla format",
    "tests/test_precision.py::test_decode_equals_forward_under_bf16_compute[mla]":
        "[mha] stays",
    "tests/test_kernels.py::test_paged_scores_kernel_matches_reference[tpu-1-fp4_ue8m0]":
        "[tpu-1-bf16] stays; FP4 keys: test_reference_matches_indexer_scores[fp4_ue8m0]",
    "tests/test_limits.py::test_cache_refuses_positions_past_max_len[v41]":
        "[v4] stays (the same ring and paged containers)",
    "tests/test_v4.py::test_future_tokens_never_leak[dsa]":
        "test_properties.py::test_forward_is_causal[dsa] stays",
    "tests/test_serve_isolation.py::test_prompts_prefilling_beside_decoding_rows_equal_their_"
    "solo_outputs[v4]": "[mha] stays; a V4 sub-batch: test_each_request_equals_its_solo_"
    "generate[v4]",
    "tests/test_indexer_impl.py::test_approx_topk_decode_equals_exact":
        "test_approx_topk_selects_the_exact_set_on_tie_free_scores stays",
    "tests/test_blocks.py::test_online_softmax_over_entry_blocks_equals_one_softmax[7]":
        "[64] stays",
    "tests/test_blocks.py::test_loss_and_gradients_do_not_depend_on_block_sizes[mla-extra3]":
        "[mha] stays",
    "tests/test_blocks.py::test_remat_changes_no_number": "every case: a rematerialisation "
        "policy; every fast training test runs the default one",
    "tests/test_readme.py::test_python_block_runs_as_written[docs/multi_device.md#0]":
        "README.md#1 (the library's API) stays; the sharded engine: tests/sharding_checks.py",
    "tests/test_precision.py::test_trainer_under_bf16_compute_steps_float32_weights":
        "test_bf16_compute_keeps_float32_parameters_and_adamw_moments stays",
    "tests/test_indexer_recall.py::test_accumulated_recall_is_the_whole_batch_recall":
        "test_recall_is_measured_in_the_dense_warmup_only keeps the metric",
    "tests/test_indexer_recall.py::test_recall_does_not_depend_on_query_blocks":
        "test_recall_is_measured_in_the_dense_warmup_only keeps the metric",
    "tests/test_indexer_recall.py::test_metrics_jsonl_has_recall_in_the_dense_warmup_only":
        "test_recall_is_measured_in_the_dense_warmup_only keeps the metric's values",
    "tests/test_properties.py::test_prefill_and_decode_equal_forward[dsa]":
        "DSA's decode against its forward: tests/test_scan.py::test_scanned_stack_equals_"
        "unrolled_and_decodes_its_forward[dsa] stays",
    "tests/test_convert.py::test_the_v3_2_recipe_runs_its_two_stages_from_a_dense_mla_run":
        "its parts stay: freezing (test_a_frozen_parameter_stays_where_it_was_and_has_no_"
        "moments), MLA -> DSA, --init-from's record and resume, the recall metric in "
        "metrics.jsonl (test_indexer_recall.py)",
    "tests/test_accum.py::test_seed_group_accumulates":
        "SeedGroup: tests/test_train.py::test_a_nan_in_one_seed_stops_the_group_naming_that_"
        "seed stays",
    "tests/test_rundir.py::test_train_script_ends_a_failed_save_with_one_line":
        "test_failed_save_call_is_a_write_error_and_bugs_keep_theirs stays",
    "tests/test_yarn.py::test_decode_equals_forward_with_yarn[dsa]": "[mla] stays",
    "tests/test_properties.py::test_prefill_and_decode_equal_forward[mqa]":
        "[gqa] (grouped K/V heads) and [mha] stay",
    "tests/test_scan.py::test_a_copys_view_of_stacked_caches_is_that_copys_cache[True]":
        "scanned decode: test_scanned_stack_equals_unrolled_and_decodes_its_forward[dsa], "
        "test_scanned_decode_updates_the_stacked_caches_in_place[mla], [mha] stay",
    "tests/test_paged.py::test_pool_groups_behave_as_separate_caches":
        "pool groups serve row shards of a mesh: the sharding checks (full tier)",
    "tests/test_indexer_impl.py::test_pallas_interpret_decode_equals_xla[dsa-pallas_gpu]":
        "the score kernels against their reference: tests/test_kernels.py stays",
    "tests/test_scripts.py::test_warnings_are_one_line_without_source":
        "test_user_errors_are_one_line stays",
    "tests/test_rundir.py::test_sigint_saves_the_step_reached_and_a_rerun_resumes_there":
        "resume: tests/test_train.py::test_resume_equals_never_stopping stays",
    "tests/test_ablate.py::test_a_second_sweep_on_the_same_directory_is_refused_naming_the_"
    "holder": "a sweep's",
    "tests/test_decode_attention.py::test_reference_is_todays_decode_attention":
        "test_kernel_equals_reference stays (the reference is checked against today's read "
        "here and model-level by test_pallas_reads's decodes)",
    "tests/test_hadamard.py::test_rotated_fp4_keys_decode_equals_the_fake_quant_forward[v4]":
        "rotated FP4 keys: test_v4.py::test_quantized_cache_decode_equals_fake_quant_forward"
        "[dsa-formats1] stays",
}


_PATTERNS = {k: re.compile(k[3:]) for k in FULL if k.startswith("re:")}


def _in_full(nodeid: str) -> str | None:
    """The FULL entry naming this node (the whole test, this case, or "re:" a pattern of
    cases), if any."""
    if nodeid in FULL:
        return nodeid
    base = nodeid.split("[", 1)[0]
    if base in FULL:
        return base
    return next((k for k, r in _PATTERNS.items() if r.match(nodeid)), None)


@pytest.hookimpl(tryfirst=True)  # before -m deselects
def pytest_collection_modifyitems(config, items):
    used = set()
    for item in items:
        key = _in_full(item.nodeid)
        if key is not None:
            item.add_marker(pytest.mark.full)
            used.add(key)
    # A renamed test must not slip into the fast tier unnoticed: when the whole suite is
    # collected, every entry names something.
    if all(os.path.isdir(a) for a in config.args):
        files = {item.nodeid.split("::", 1)[0] for item in items}
        stale = [k for k in FULL if k not in used and
                 k.removeprefix("re:").split("::", 1)[0] in files]
        if stale:
            raise pytest.UsageError("tests/conftest.py FULL names no test: " + ", ".join(stale))


# --- Compile count: every backend compilation jax reports in this process (xdist workers
# send theirs to the controller), summed and printed at the end with the tests that compiled
# most. Programs compiled inside subprocesses (scripts, the sharding checks) are not counted.

from dsattn.bench.compiles import COMPILE_EVENT  # noqa: E402

_compiles = {"n": 0, "secs": 0.0}
_per_test: dict = {}
_current = [None]


def _on_compile(event, duration, **kwargs):
    if event == COMPILE_EVENT:
        _compiles["n"] += 1
        _compiles["secs"] += duration
        if _current[0] is not None:
            n, s = _per_test.get(_current[0], (0, 0.0))
            _per_test[_current[0]] = (n + 1, s + duration)


jax.monitoring.register_event_duration_secs_listener(_on_compile)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    _current[0] = item.nodeid
    yield
    _current[0] = None


def pytest_sessionfinish(session):
    out = getattr(session.config, "workeroutput", None)
    if out is not None:  # an xdist worker: hand the counts to the controller
        out["dsattn_compiles"] = dict(_compiles)
        out["dsattn_per_test"] = {k: list(v) for k, v in _per_test.items()}


def pytest_testnodedown(node, error):
    out = getattr(node, "workeroutput", {})
    _compiles["n"] += out.get("dsattn_compiles", {}).get("n", 0)
    _compiles["secs"] += out.get("dsattn_compiles", {}).get("secs", 0.0)
    for k, (n, s) in out.get("dsattn_per_test", {}).items():
        _per_test[k] = (n, s)


def pytest_terminal_summary(terminalreporter):
    tr = terminalreporter
    tr.write_sep("=", f"jax compilations (in-process): {_compiles['n']} programs, "
                      f"{_compiles['secs']:.0f} s compiling")
    top = sorted(_per_test.items(), key=lambda kv: -kv[1][1])[:15]
    for k, (n, s) in top:
        tr.write_line(f"{s:7.1f}s {n:4d} compiles  {k}")
