// The paged op library: every schema (docs/design.md, section 3), in one place. Kernels live in
// csrc/cpu/ (TORCH_LIBRARY_IMPL(paged, CPU, ...)) and csrc/cuda/ (TORCH_LIBRARY_IMPL(paged,
// CUDA, ...)); fake (meta) implementations are registered from Python in paged_ops/_fake.py.
#include <Python.h>
#include <torch/library.h>

TORCH_LIBRARY(paged, m) {
  // Tell torch where the fake impls live, so that using the ops under torch.compile without
  // importing paged_ops gives a clear error instead of a missing-kernel one.
  m.set_python_module("paged_ops._fake");
  m.def(
      "reshape_and_cache(Tensor key, Tensor value, Tensor(a!) key_cache, Tensor(b!) value_cache,"
      " Tensor slot_mapping, Tensor? k_scale=None, Tensor? v_scale=None) -> ()",
      {at::Tag::pt2_compliant_tag});
  m.def(
      "attention(Tensor query, Tensor key_cache, Tensor value_cache, Tensor block_tables,"
      " Tensor seq_lens, float scale, Tensor? alibi_slopes=None, int sliding_window=-1,"
      " float logits_soft_cap=0.0, Tensor? k_scale=None, Tensor? v_scale=None,"
      " int? max_seq_len=None, Tensor? query_start_loc=None, bool causal=True) -> Tensor",
      {at::Tag::pt2_compliant_tag});
  m.def(
      "attention_with_lse(Tensor query, Tensor key_cache, Tensor value_cache,"
      " Tensor block_tables, Tensor seq_lens, float scale, Tensor? alibi_slopes=None,"
      " int sliding_window=-1, float logits_soft_cap=0.0, Tensor? k_scale=None,"
      " Tensor? v_scale=None, int? max_seq_len=None, Tensor? query_start_loc=None,"
      " bool causal=True) -> (Tensor, Tensor)",
      {at::Tag::pt2_compliant_tag});
  m.def(
      "attention_out(Tensor(a!) out, Tensor query, Tensor key_cache, Tensor value_cache,"
      " Tensor block_tables, Tensor seq_lens, float scale, Tensor? alibi_slopes=None,"
      " int sliding_window=-1, float logits_soft_cap=0.0, Tensor? k_scale=None,"
      " Tensor? v_scale=None, int? max_seq_len=None, Tensor? query_start_loc=None,"
      " bool causal=True) -> ()",
      {at::Tag::pt2_compliant_tag});
  m.def(
      "copy_blocks(Tensor(a!)[] key_caches, Tensor(b!)[] value_caches, Tensor block_mapping)"
      " -> ()",
      {at::Tag::pt2_compliant_tag});
  m.def(
      "merge_attention_states(Tensor out_a, Tensor lse_a, Tensor out_b, Tensor lse_b)"
      " -> (Tensor, Tensor)",
      {at::Tag::pt2_compliant_tag});
  m.def("swap_blocks(Tensor src, Tensor(a!) dst, Tensor block_mapping) -> ()",
        {at::Tag::pt2_compliant_tag});
}

// `import paged_ops._C` loads this library (running the registrations above); the module itself
// has no Python-visible members.
extern "C" PyMODINIT_FUNC PyInit__C(void) {
  static struct PyModuleDef module_def = {PyModuleDef_HEAD_INIT, "_C", nullptr, -1, nullptr};
  return PyModule_Create(&module_def);
}
