"""Tests left out of the quick run (``python -m pytest -m "not slow"``) although each takes under ~20 s.

The quick run must stay under 5 minutes on 2 cores and still check every promise once. These cases check a
promise that a faster case in the quick run already checks (another parametrization of the same test, or
another fault of the same kind through the same code path); ``conftest.py`` marks them ``slow``, so CI, which
runs everything, still runs them. Each entry names the case that keeps the promise in the quick run.
Whole tests that take longer are marked ``@pytest.mark.slow`` where they are defined.
"""

from __future__ import annotations

SLOW_IN_QUICK_RUN: dict[str, str] = {
    # the fused head and loss: kept by test_the_decoder_fused_head_loss_matches_its_unfused_path[2-msp-True-fp32]
    "tests/test_chunked_loss.py::test_the_decoder_fused_head_loss_matches_its_unfused_path[4-msp-False-fp32]":
        "[2-msp-True-fp32]",
    "tests/test_chunked_loss.py::test_the_decoder_fused_head_loss_matches_its_unfused_path[2-mtp-True-fp32]":
        "[2-msp-True-fp32]",
    "tests/test_chunked_loss.py::test_the_decoder_fused_head_loss_matches_its_unfused_path[2-msp-True-bf16]":
        "[2-msp-True-fp32]",
    "tests/test_chunked_loss.py::test_the_decoder_fused_head_loss_matches_its_unfused_path[2-mtp-False-fp32]":
        "[2-msp-True-fp32]",
    "tests/test_chunked_loss.py::test_vocab_parallel_matches_one_rank[4]":
        "test_the_decoder_fused_head_loss_matches_its_unfused_path[2-msp-True-fp32]",
    "tests/test_chunked_loss.py::test_the_activation_closed_form_counts_the_fused_head":
        "test_wgrad_fusion.py::test_the_fused_head_never_holds_an_fp32_weight_gradient_buffer",
    "tests/test_wgrad_fusion.py::test_the_decoder_gets_the_same_main_grads_fused_and_unfused[2-msp-False]":
        "[1-mtp-True] and the single-process fp64 checks",
    # faults: one of each kind stays
    "tests/test_reliability.py::test_a_hung_rank_is_caught_by_the_collective_timeout[shm]": "[gloo]",
    "tests/test_reliability.py::test_a_rank_raising_mid_step_stops_the_job_without_a_forced_kill":
        "test_reliability.py::test_nan_loss_in_bf16_skips_on_both_ranks_then_stops_naming_step_and_checkpoint",
    "tests/test_resume_agreement.py::test_one_ranks_bad_file_makes_every_rank_fall_back_or_stop_together[dp4]": "[dp2]",
    "tests/test_resume_agreement.py::test_error_texts_reach_every_rank_grouped_by_text": "[dp2]",
    "tests/test_resume_agreement.py::test_train_py_stops_with_one_error_line_when_no_step_is_readable_by_rank1": "[dp2]",
    "tests/test_io_faults.py::test_a_log_folder_filling_up_mid_run_stops_every_rank_after_saving":
        "test_a_file_error_reaching_run_is_one_line_naming_what_was_being_done",
    "tests/test_io_faults.py::test_a_stop_file_that_cannot_be_removed_is_an_error_on_every_rank":
        "test_a_file_error_reaching_run_is_one_line_naming_what_was_being_done",
    "tests/test_io_faults.py::test_a_failed_stdlib_preparation_on_rank_0_stops_every_rank":
        "test_a_file_error_reaching_run_is_one_line_naming_what_was_being_done",
    "tests/test_io_faults.py::test_a_missing_weights_only_start_names_its_key":
        "test_a_file_error_reaching_run_is_one_line_naming_what_was_being_done",
    "tests/test_io_faults.py::test_a_metrics_file_that_cannot_be_opened_stops_every_rank_before_training[metrics.jsonl]":
        "test_a_file_error_reaching_run_is_one_line_naming_what_was_being_done",
    "tests/test_io_faults.py::test_a_metrics_file_that_cannot_be_opened_stops_every_rank_before_training[tensorboard]":
        "test_a_file_error_reaching_run_is_one_line_naming_what_was_being_done",
    "tests/test_io_faults.py::test_unreadable_token_files_stop_every_rank_with_one_line[*]":
        "test_train.py::test_bad_data_stops_every_rank_with_a_clear_message[missing]",
    "tests/test_io_faults.py::test_unreadable_token_files_stop_every_rank_with_one_line[1]":
        "test_train.py::test_bad_data_stops_every_rank_with_a_clear_message[missing]",
    "tests/test_io_faults.py::test_metrics_failing_mid_run_stop_every_rank_after_saving":
        "test_a_file_error_reaching_run_is_one_line_naming_what_was_being_done",
    "tests/test_train.py::test_bad_data_stops_every_rank_with_a_clear_message[bad_token]": "[missing]",
    "tests/test_train.py::test_bad_data_stops_every_rank_with_a_clear_message[empty]": "[missing]",
    "tests/test_train.py::test_bad_data_stops_every_rank_with_a_clear_message[seq_too_long]": "[missing]",
    "tests/test_train.py::test_bad_data_stops_every_rank_with_a_clear_message[truncated]": "[missing]",
    "tests/test_env_faults.py::test_no_space_on_a_small_tmpfs":
        "test_train_py_reports_an_unwritable_checkpoint_folder_on_every_rank_before_training",
    "tests/test_env_faults.py::test_no_space_injected_into_one_ranks_write":
        "test_train_py_reports_an_unwritable_checkpoint_folder_on_every_rank_before_training",
    # launch faults and the save-folder lock
    "tests/test_launch_faults.py::test_fewer_processes_than_the_world_size":
        "test_a_rendezvous_nobody_answers_names_host_port_and_the_wait",
    "tests/test_launch_faults.py::test_nccl_without_cuda_under_torchrun_stops_every_rank":
        "test_nccl_rule.py (the NCCL rules on CPU)",
    "tests/test_launch_faults.py::test_a_port_another_program_holds":
        "test_a_rendezvous_nobody_answers_names_host_port_and_the_wait",
    "tests/test_launch_faults.py::test_a_rank_outside_the_world_size": "test_a_rank_started_twice_is_named",
    "tests/test_launch_faults.py::test_master_addr_that_does_not_resolve_and_its_traceback_at_debug_level":
        "test_a_rendezvous_nobody_answers_names_host_port_and_the_wait",
    "tests/test_save_folder_lock.py::test_train_py_refuses_a_held_save_folder_before_training":
        "test_a_second_process_is_refused_naming_the_holder_then_takes_the_folder_once_it_is_killed",
    "tests/test_save_folder_lock.py::test_fine_tuning_from_a_held_folder_only_reads_it":
        "test_a_second_process_is_refused_naming_the_holder_then_takes_the_folder_once_it_is_killed",
    "tests/test_context.py::test_group_membership[world4-tp1]": "[world2-tp1]",
    "tests/test_context.py::test_group_membership[world1-tp1]": "[world2-tp1]",
    "tests/test_context.py::test_slurm_launch_matches_torchrun":
        "test_launch_faults.py (the slurm variables) and test_group_membership[world2-tp1]",
    "tests/test_context.py::test_helper_propagates_failure_without_hanging":
        "test_world_size_not_tp_times_dp_fails_on_every_rank",
    # the shared-memory TP route
    "tests/test_shm_comm.py::test_launch_keeps_gloo_when_tensor_parallel_is_off": "test_launch_routes_tensor_all_reduce[auto-env0-True]",
    "tests/test_shm_comm.py::test_launch_routes_tensor_all_reduce[off-env1-False]": "[auto-env0-True]",
    "tests/test_shm_comm.py::test_launch_routes_tensor_all_reduce[auto-env2-False]": "[auto-env0-True]",
    "tests/test_shm_comm.py::test_launch_routes_tensor_all_reduce[on-env3-True]": "[auto-env0-True]",
    "tests/test_shm_comm.py::test_missing_peer_times_out_naming_it": "test_exited_peer_is_an_error_at_once",
    "tests/test_shm_comm.py::test_equals_gloo_all_reduce_and_all_gather[3]": "[2]",
    "tests/test_shm_comm.py::test_gather_tensor_goes_through_the_route[3]": "test_equals_gloo_all_reduce_and_all_gather[2]",
    # planning and memory
    "tests/test_plan.py::test_7b_plan_is_small_and_exact": "test_train_py_dry_run_prints_the_plan",
    "tests/test_plan.py::test_traced_peak_equals_a_real_cpu_step[2-parallel.zero1.size=2-model.checkpoint=True-"
    "model.dtype='torch.bfloat16']": "[2-parallel.zero1.size=1-model.checkpoint=False-model.dtype='torch.float32']",
    "tests/test_plan.py::test_traced_peak_equals_a_real_cpu_step[2-parallel.tensor.size=2-model.checkpoint="
    "'selective'-model.dtype='torch.bfloat16'-parallel.tensor.mode='msp']":
        "[2-parallel.zero1.size=1-model.checkpoint=False-model.dtype='torch.float32']",
    "tests/test_plan.py::test_gloo_private_copies_are_not_counted_as_the_step_s_memory":
        "test_traced_peak_equals_a_real_cpu_step (its quick case)",
    "tests/test_sequence_parallel.py::test_measured_activation_peak_matches_closed_form":
        "test_plan.py::test_traced_peak_equals_a_real_cpu_step (its quick case)",
    "tests/test_lowp_masters.py::test_zero_1_and_2_give_the_same_weights_for_every_policy":
        "test_measured_bytes_per_parameter_equal_the_closed_form_with_and_without_zero",
    "tests/test_optimizer_dist.py::test_precision_report_zero1_2": "test_precision_report.py",
    "tests/test_sharded_optimizer_checkpoint.py::test_offline_source_reads_sharded_optimizer_files":
        "test_zero_ranks_write_their_shards_and_resume_bitwise_in_any_layout",
    # families, interop, tools, benchmarks
    "tests/test_hf_families.py::test_family_imports_exports_and_trains[mistral]": "[llama3]",
    "tests/test_hf_families.py::test_family_imports_exports_and_trains[qwen2]": "[llama3]",
    "tests/test_hf_families.py::test_family_imports_exports_and_trains[llama-head_dim]": "[llama3]",
    "tests/test_interop.py::test_imported_checkpoint_fine_tunes_with_train_py": "test_hf_families.py [llama3]",
    "tests/test_internevo_config.py::test_train_py_trains_a_shrunk_internevo_config":
        "the config-loading tests of test_internevo_config.py",
    "tests/test_compile.py::test_family_features_compile_without_a_break":
        "test_compiled_blocks_match_eager (its quick cases)",
    "tests/test_fused_ops.py::test_sequence_parallel_weight_gradient_matches_one_process[bfloat16]": "[float32]",
    "tests/test_fp8.py::test_tp2_equals_tp1[tensorwise]": "test_fp8_model_at_tp2_equals_tp1[tensorwise-mtp]",
    "tests/test_precision_telemetry_dist.py::test_train_py_writes_the_figures_to_metrics_jsonl_and_tensorboard":
        "test_tp2_and_dp2_figures_equal_tp1",
    "tests/test_gpu_acceptance_tool.py::test_a_training_run_is_judged_from_its_metrics":
        "the tool's other quick tests",
    "tests/test_tensor_modes_bench.py::test_end_to_end_on_the_tiny_config": "test_bench.py",
    "tests/test_hf_families.py::test_family_imports_exports_and_trains[qwen3]": "[llama3]",
    "tests/test_optimizer_dist.py::test_dp_reduction_overlaps_backward_and_changes_nothing":
        "test_promises_optim.py's DP=2 run and test_zero1_equivalence_memory_and_resharded_resume",
    "tests/test_chunked_loss.py::test_vocab_parallel_matches_one_rank[2]":
        "test_the_decoder_fused_head_loss_matches_its_unfused_path[2-msp-True-fp32]",
    "tests/test_shm_comm.py::test_gather_tensor_goes_through_the_route[2]": "test_equals_gloo_all_reduce_and_all_gather[2]",
    "tests/test_text_data.py::test_train_py_on_a_raw_file_has_the_losses_of_the_prepared_folder[jsonl]":
        "[parquet], and the JSON lines readers' batches in test_text_gives_the_batches_of_a_prepared_folder_bit_for_bit",
}

# Cases that exist only for the quick run: each checks a strict subset of what a slow test checks (named here),
# so a run that includes the slow tests (CI) skips them instead of paying for the same promise twice.
QUICK_ONLY: dict[str, str] = {
    "tests/test_model.py::test_tensor_parallel_model_at_tp4_matches_tp1_quick":
        "test_model.py::test_tensor_parallel_model_matches_tp1 (TP=4 among its groups)",
    "tests/test_precision_matrix.py::test_one_cell_per_dtype_at_tp2":
        "test_precision_matrix.py::test_precision_matrix[tp2] (every cell, these included)",
}
