"""The asm decode kernel set is detected from the installed AITER, not assumed.

Routing checks a route against the kernels the installed AITER's ``hsa/<arch>/mla/mla_asm.csv``
provides, derived once per installation (``native.installed_kernel_set``); the static tables
(``capabilities.ASM_KERNELS``) serve where no installation is found and must equal the tables
derived from the pinned commit's csv (reproduced here), so the two cannot drift. Fake
installations are tmp directories holding a csv (no code objects: routing reads only the csv).
"""

from __future__ import annotations

import warnings

import jax.numpy as jnp
import pytest

from jax_mla.backends.aiter import build_aiter_decode_metadata, native
from jax_mla.backends.aiter import capabilities as caps

# hsa/<arch>/mla/mla_asm.csv at ROCm/aiter e4048607 (caps.AITER_COMMIT), every row.
PINNED_CSV = {
    "gfx942": """\
qType,kvType,Gqa,ps,qSeqLen,prefill,causal,lse,knl_name,co_name
bf16,bf16,128,0,0,0,1,0,_ZN5aiter41mla_dec_stage1_bf16_a16w16_subQ128_mqa128E,mla_dec_stage1_bf16_a16w16_subQ128_mqa128.co
bf16,bf16,16,1,4,0,1,0,_ZN5aiter42mla_a16w16_qh16_m16x4_n16x1_coex0_mask1_psE,mla_a16w16_qh16_m16x4_n16x1_coex0_mask1_ps.co
bf16,bf16,16,0,1,0,1,0,_ZN5aiter39mla_dec_stage1_bf16_a16w16_subQ16_mqa16E,mla_dec_stage1_bf16_a16w16_subQ16_mqa16.co
bf16,bf16,16,0,4,0,1,0,_ZN5aiter39mla_a16w16_qh16_m16x4_n16x1_coex0_mask1E,mla_a16w16_qh16_m16x4_n16x1_coex0_mask1.co
bf16,bf16,16,0,8,0,1,0,_ZN5aiter39mla_a16w16_qh16_m32x4_n16x1_coex0_mask1E,mla_a16w16_qh16_m32x4_n16x1_coex0_mask1.co
bf16,fp8,16,1,4,0,1,0,_ZN5aiter41mla_a16w8_qh16_m16x4_n16x1_coex0_mask1_psE,mla_a16w8_qh16_m16x4_n16x1_coex0_mask1_ps.co
bf16,byte,16,1,4,0,1,0,_ZN5aiter53mla_a16w8_qh16_m16x4_n16x1_coex0_mask1_ps_page64_ds32E,mla_a16w8_qh16_m16x4_n16x1_coex0_mask1_ps_page64_ds32.co
fp8,fp8,16,1,1,0,1,0,_ZN5aiter36mla_a8w8_qh16_qseqlen1_gqaratio16_psE,mla_a8w8_qh16_qseqlen1_gqaratio16_ps.co
fp8,fp8,64,1,1,0,1,0,_ZN5aiter39mla_a8w8_qh64_qseqlen1_gqaratio64_v3_psE,mla_a8w8_qh64_qseqlen1_gqaratio64_v3_ps.co
fp8,fp8,64,1,1,0,1,1,_ZN5aiter43mla_a8w8_qh64_qseqlen1_gqaratio64_lse_v3_psE,mla_a8w8_qh64_qseqlen1_gqaratio64_lse_v3_ps.co
fp8,fp8,16,1,2,0,1,0,_ZN5aiter36mla_a8w8_qh16_qseqlen2_gqaratio16_psE,mla_a8w8_qh16_qseqlen2_gqaratio16_ps.co
fp8,fp8,16,1,4,0,1,0,_ZN5aiter36mla_a8w8_qh64_qseqlen4_gqaratio16_psE,mla_a8w8_qh64_qseqlen4_gqaratio16_ps.co
fp8,fp8,16,0,1,0,1,0,_ZN5aiter33mla_a8w8_qh16_qseqlen1_gqaratio16E,mla_a8w8_qh16_qseqlen1_gqaratio16.co
fp8,fp8,16,0,2,0,1,0,_ZN5aiter33mla_a8w8_qh16_qseqlen2_gqaratio16E,mla_a8w8_qh16_qseqlen2_gqaratio16.co
fp8,fp8,16,0,4,0,1,0,_ZN5aiter33mla_a8w8_qh64_qseqlen4_gqaratio16E,mla_a8w8_qh64_qseqlen4_gqaratio16.co
fp8,fp8,128,0,0,0,1,0,_ZN5aiter31mla_a8w8_qh128_m32x4_n16x2_msk1E,mla_a8w8_qh128_m32x4_n16x2_msk1.co
bf16,bf16,16,0,0,1,0,0,_ZN5aiter39mla_pfl_bf16_a16w16_causal_subQ16_mqa16E,mla_pfl_bf16_a16w16_causal_subQ16_mqa16.co
bf16,bf16,128,0,0,1,0,0,_ZN5aiter41mla_pfl_bf16_a16w16_causal_subQ128_mqa128E,mla_pfl_bf16_a16w16_causal_subQ128_mqa128.co
fp8,fp8,128,1,0,0,1,0,_ZN5aiter34mla_a8w8_qh128_m32x4_n16x2_msk0_psE,mla_a8w8_qh128_m32x4_n16x2_msk0_ps.co
fp8,fp8,1,1,0,1,1,0,_ZN5aiter40mla_pfl_qh192_vh128_m32x8_n128x1_causal1E,mla_pfl_qh192_vh128_m32x8_n128x1_causal1.co
fp8,fp8,1,1,0,1,0,0,_ZN5aiter40mla_pfl_qh192_vh128_m32x8_n128x1_causal0E,mla_pfl_qh192_vh128_m32x8_n128x1_causal0.co
bf16,bf16,32,0,0,0,1,0,_ZN5aiter39mla_a16w16_qh16_m32x1_n16x1_coex0_mask1E,MLA_A16W16_1TG_4W_32mx1_16nx1_Coex0_Msk1_QH16.co
bf16,bf16,64,0,0,0,1,0,_ZN5aiter39mla_a16w16_qh16_m64x1_n16x1_coex0_mask1E,MLA_A16W16_1TG_4W_64mx1_16nx1_Coex0_Msk1_QH16.co
bf16,bf16,8,0,1,0,1,0,_ZN5aiter36mla_a16w16_qh8_qseqlen1_gqaratio8_v3E,mla_a16w16_qh8_qseqlen1_gqaratio8_v3.co
fp8,fp8,8,0,1,0,1,0,_ZN5aiter35mla_a8w8_qh8_qseqlen1_gqaratio8_v1E,mla_a8w8_qh8_qseqlen1_gqaratio8_v1.co
bf16,bf16,8,1,2,0,1,0,_ZN5aiter42mla_dec_stage1_bf16_a16w16_subQ16_mqa16_psE,mla_dec_stage1_bf16_a16w16_subQ16_mqa16_ps.co
""",
    "gfx950": """\
qType,kvType,Gqa,ps,qSeqLen,prefill,causal,lse,cprr,knl_name,co_name
bf16,bf16,128,0,0,0,1,0,0,_ZN5aiter41mla_dec_stage1_bf16_a16w16_subQ128_mqa128E,mla_dec_stage1_bf16_a16w16_subQ128_mqa128.co
bf16,bf16,16,1,4,0,1,0,0,_ZN5aiter42mla_a16w16_qh16_m16x4_n16x1_coex0_mask1_psE,mla_a16w16_qh16_m16x4_n16x1_coex0_mask1_ps.co
bf16,bf16,16,1,4,0,1,1,0,_ZN5aiter46mla_a16w16_qh16_m16x4_n16x1_coex0_mask1_lse_psE,mla_a16w16_qh16_m16x4_n16x1_coex0_mask1_lse_ps.co
bf16,bf16,16,0,1,0,1,0,0,_ZN5aiter39mla_dec_stage1_bf16_a16w16_subQ16_mqa16E,mla_dec_stage1_bf16_a16w16_subQ16_mqa16.co
bf16,bf16,16,0,4,0,1,0,0,_ZN5aiter39mla_a16w16_qh16_m16x4_n16x1_coex0_mask1E,mla_a16w16_qh16_m16x4_n16x1_coex0_mask1.co
bf16,bf16,16,0,8,0,1,0,0,_ZN5aiter39mla_a16w16_qh16_m32x4_n16x1_coex0_mask1E,mla_a16w16_qh16_m32x4_n16x1_coex0_mask1.co
bf16,fp8,16,1,4,0,1,0,0,_ZN5aiter41mla_a16w8_qh16_m16x4_n16x1_coex0_mask1_psE,mla_a16w8_qh16_m16x4_n16x1_coex0_mask1_ps.co
fp8,fp8,16,1,1,0,1,0,0,_ZN5aiter36mla_a8w8_qh16_qseqlen1_gqaratio16_psE,mla_a8w8_qh16_qseqlen1_gqaratio16_ps.co
fp8,fp8,16,1,1,0,1,1,0,_ZN5aiter40mla_a8w8_qh16_qseqlen1_gqaratio16_lse_psE,mla_a8w8_qh16_qseqlen1_gqaratio16_lse_ps.co
fp8,fp8,16,1,2,0,1,0,0,_ZN5aiter36mla_a8w8_qh16_qseqlen2_gqaratio16_psE,mla_a8w8_qh16_qseqlen2_gqaratio16_ps.co
fp8,fp8,16,1,4,0,1,0,0,_ZN5aiter39mla_a8w8_qh16_qseqlen4_gqaratio16_v3_psE,mla_a8w8_qh16_qseqlen4_gqaratio16_v3_ps.co
fp8,fp8,16,1,4,0,1,1,0,_ZN5aiter43mla_a8w8_qh16_qseqlen4_gqaratio16_lse_v3_psE,mla_a8w8_qh16_qseqlen4_gqaratio16_lse_v3_ps.co
fp8,fp8,16,0,1,0,1,0,0,_ZN5aiter33mla_a8w8_qh16_qseqlen1_gqaratio16E,mla_a8w8_qh16_qseqlen1_gqaratio16.co
fp8,fp8,16,0,2,0,1,0,0,_ZN5aiter33mla_a8w8_qh16_qseqlen2_gqaratio16E,mla_a8w8_qh16_qseqlen2_gqaratio16.co
fp8,fp8,16,0,4,0,1,0,0,_ZN5aiter33mla_a8w8_qh64_qseqlen4_gqaratio16E,mla_a8w8_qh64_qseqlen4_gqaratio16.co
fp8,fp8,32,1,4,0,1,0,0,_ZN5aiter36mla_a8w8_qh32_qseqlen4_gqaratio32_psE,mla_a8w8_qh32_qseqlen4_gqaratio32_ps.co
fp8,fp8,32,1,4,0,1,1,0,_ZN5aiter40mla_a8w8_qh32_qseqlen4_gqaratio32_lse_psE,mla_a8w8_qh32_qseqlen4_gqaratio32_lse_ps.co
fp8,fp8,32,1,1,0,1,0,0,_ZN5aiter36mla_a8w8_qh32_qseqlen1_gqaratio32_psE,mla_a8w8_qh32_qseqlen1_gqaratio32_ps.co
fp8,fp8,32,1,1,0,1,1,0,_ZN5aiter40mla_a8w8_qh32_qseqlen1_gqaratio32_lse_psE,mla_a8w8_qh32_qseqlen1_gqaratio32_lse_ps.co
fp8,fp8,16,1,4,0,1,0,1,_ZN5aiter44mla_a8w8_qh16_qseqlen4_gqaratio16_cprr_v3_psE,mla_a8w8_qh16_qseqlen4_gqaratio16_cprr_v3_ps.co
fp8,fp8,16,1,4,0,1,1,1,_ZN5aiter48mla_a8w8_qh16_qseqlen4_gqaratio16_lse_cprr_v3_psE,mla_a8w8_qh16_qseqlen4_gqaratio16_lse_cprr_v3_ps.co
fp8,fp8,32,1,4,0,1,0,1,_ZN5aiter41mla_a8w8_qh32_qseqlen4_gqaratio32_cprr_psE,mla_a8w8_qh32_qseqlen4_gqaratio32_cprr_ps.co
fp8,fp8,32,1,4,0,1,1,1,_ZN5aiter45mla_a8w8_qh32_qseqlen4_gqaratio32_lse_cprr_psE,mla_a8w8_qh32_qseqlen4_gqaratio32_lse_cprr_ps.co
fp8,fp8,128,0,0,0,1,0,0,_ZN5aiter31mla_a8w8_qh128_m32x4_n16x2_msk1E,mla_a8w8_qh128_m32x4_n16x2_msk1.co
bf16,bf16,16,0,0,1,0,0,0,_ZN5aiter39mla_pfl_bf16_a16w16_causal_subQ16_mqa16E,mla_pfl_bf16_a16w16_causal_subQ16_mqa16.co
bf16,bf16,128,0,0,1,0,0,0,_ZN5aiter41mla_pfl_bf16_a16w16_causal_subQ128_mqa128E,mla_pfl_bf16_a16w16_causal_subQ128_mqa128.co
fp8,fp8,1,1,0,1,1,0,0,_ZN5aiter40mla_pfl_qh192_vh128_m32x8_n128x1_causal1E,mla_pfl_qh192_vh128_m32x8_n128x1_causal1.co
fp8,fp8,1,1,0,1,0,0,0,_ZN5aiter40mla_pfl_qh192_vh128_m32x8_n128x1_causal0E,mla_pfl_qh192_vh128_m32x8_n128x1_causal0.co
bf16,bf16,32,0,0,0,1,0,0,_ZN5aiter39mla_a16w16_qh16_m16x4_n32x1_coex0_mask1E,MLA_A16W16_1TG_4W_16mx4_32nx1_Coex0_Msk1_QH16.co
bf16,bf16,64,0,0,0,1,0,0,_ZN5aiter39mla_a16w16_qh16_m64x1_n16x1_coex0_mask1E,MLA_A16W16_1TG_4W_64mx1_16nx1_Coex0_Msk1_QH16.co
bf16,bf16,64,0,1,0,1,0,0,_ZN5aiter38mla_a16w16_qh64_qseqlen1_gqaratio64_v3E,mla_a16w16_qh64_qseqlen1_gqaratio64_v3.co
bf16,bf16,8,0,1,0,1,0,0,_ZN5aiter36mla_a16w16_qh8_qseqlen1_gqaratio8_v3E,mla_a16w16_qh8_qseqlen1_gqaratio8_v3.co
bf16,bf16,8,0,2,0,1,0,0,_ZN5aiter33mla_a16w16_qh8_qseqlen2_gqaratio8E,mla_a16w16_qh8_qseqlen2_gqaratio8.co
bf16,bf16,8,0,2,0,1,0,0,_ZN5aiter40mla_a16w16_qh8_qseqlen2_gqaratio8_causalE,mla_a16w16_qh8_qseqlen2_gqaratio8_causal.co
fp8,fp8,8,0,1,0,1,0,0,_ZN5aiter34mla_a8w8_qh8_qseqlen1_gqaratio8_v3E,mla_a8w8_qh8_qseqlen1_gqaratio8_v3.co
fp8,fp8,8,1,4,0,1,0,0,_ZN5aiter35mla_a8w8_qh32_qseqlen4_gqaratio8_psE,mla_a8w8_qh32_qseqlen4_gqaratio8_ps.co
fp8,fp8,8,1,4,0,1,1,0,_ZN5aiter39mla_a8w8_qh32_qseqlen4_gqaratio8_lse_psE,mla_a8w8_qh32_qseqlen4_gqaratio8_lse_ps.co
bf16,bf16,32,1,4,0,1,0,0,_ZN5aiter38mla_a16w16_qh32_qseqlen4_gqaratio32_psE,mla_a16w16_qh32_qseqlen4_gqaratio32_ps.co
bf16,bf16,32,1,4,0,1,1,0,_ZN5aiter42mla_a16w16_qh32_qseqlen4_gqaratio32_lse_psE,mla_a16w16_qh32_qseqlen4_gqaratio32_lse_ps.co
bf16,bf16,32,1,4,0,1,0,1,_ZN5aiter43mla_a16w16_qh32_qseqlen4_gqaratio32_cprr_psE,mla_a16w16_qh32_qseqlen4_gqaratio32_cprr_ps.co
bf16,bf16,32,1,4,0,1,1,1,_ZN5aiter47mla_a16w16_qh32_qseqlen4_gqaratio32_lse_cprr_psE,mla_a16w16_qh32_qseqlen4_gqaratio32_lse_cprr_ps.co
bf16,bf16,32,1,4,0,0,0,0,_ZN5aiter43mla_a16w16_qh32_qseqlen4_gqaratio32_msk0_psE,mla_a16w16_qh32_qseqlen4_gqaratio32_msk0_ps.co
bf16,bf16,32,1,4,0,0,1,0,_ZN5aiter47mla_a16w16_qh32_qseqlen4_gqaratio32_msk0_lse_psE,mla_a16w16_qh32_qseqlen4_gqaratio32_msk0_lse_ps.co
bf16,bf16,32,1,4,0,0,0,1,_ZN5aiter48mla_a16w16_qh32_qseqlen4_gqaratio32_msk0_cprr_psE,mla_a16w16_qh32_qseqlen4_gqaratio32_msk0_cprr_ps.co
bf16,bf16,32,1,4,0,0,1,1,_ZN5aiter52mla_a16w16_qh32_qseqlen4_gqaratio32_msk0_lse_cprr_psE,mla_a16w16_qh32_qseqlen4_gqaratio32_msk0_lse_cprr_ps.co
bf16,bf16,64,1,1,0,1,0,0,_ZN5aiter41mla_a16w16_qh64_qseqlen1_gqaratio64_v3_psE,mla_a16w16_qh64_qseqlen1_gqaratio64_v3_ps.co
bf16,bf16,64,1,1,0,1,1,0,_ZN5aiter45mla_a16w16_qh64_qseqlen1_gqaratio64_lse_v3_psE,mla_a16w16_qh64_qseqlen1_gqaratio64_lse_v3_ps.co
bf16,bf16,64,1,1,0,1,0,1,_ZN5aiter46mla_a16w16_qh64_qseqlen1_gqaratio64_cprr_v3_psE,mla_a16w16_qh64_qseqlen1_gqaratio64_cprr_v3_ps.co
bf16,bf16,64,1,1,0,1,1,1,_ZN5aiter50mla_a16w16_qh64_qseqlen1_gqaratio64_lse_cprr_v3_psE,mla_a16w16_qh64_qseqlen1_gqaratio64_lse_cprr_v3_ps.co
bf16,bf16,64,1,1,0,0,0,0,_ZN5aiter46mla_a16w16_qh64_qseqlen1_gqaratio64_msk0_v3_psE,mla_a16w16_qh64_qseqlen1_gqaratio64_msk0_v3_ps.co
bf16,bf16,64,1,1,0,0,1,0,_ZN5aiter50mla_a16w16_qh64_qseqlen1_gqaratio64_msk0_lse_v3_psE,mla_a16w16_qh64_qseqlen1_gqaratio64_msk0_lse_v3_ps.co
bf16,bf16,64,1,1,0,0,0,1,_ZN5aiter51mla_a16w16_qh64_qseqlen1_gqaratio64_msk0_cprr_v3_psE,mla_a16w16_qh64_qseqlen1_gqaratio64_msk0_cprr_v3_ps.co
bf16,bf16,64,1,1,0,0,1,1,_ZN5aiter55mla_a16w16_qh64_qseqlen1_gqaratio64_msk0_lse_cprr_v3_psE,mla_a16w16_qh64_qseqlen1_gqaratio64_msk0_lse_cprr_v3_ps.co
fp8,fp8,8,1,4,0,0,0,0,_ZN5aiter40mla_a8w8_qh32_qseqlen4_gqaratio8_msk0_psE,mla_a8w8_qh32_qseqlen4_gqaratio8_msk0_ps.co
fp8,fp8,8,1,4,0,0,1,0,_ZN5aiter44mla_a8w8_qh32_qseqlen4_gqaratio8_msk0_lse_psE,mla_a8w8_qh32_qseqlen4_gqaratio8_msk0_lse_ps.co
fp8,fp8,16,0,1,0,0,0,0,_ZN5aiter38mla_a8w8_qh16_qseqlen1_gqaratio16_msk0E,mla_a8w8_qh16_qseqlen1_gqaratio16_msk0.co
fp8,fp8,16,0,4,0,0,0,0,_ZN5aiter38mla_a8w8_qh64_qseqlen4_gqaratio16_msk0E,mla_a8w8_qh64_qseqlen4_gqaratio16_msk0.co
fp8,fp8,16,1,1,0,0,0,0,_ZN5aiter41mla_a8w8_qh16_qseqlen1_gqaratio16_msk0_psE,mla_a8w8_qh16_qseqlen1_gqaratio16_msk0_ps.co
fp8,fp8,16,1,1,0,0,1,0,_ZN5aiter45mla_a8w8_qh16_qseqlen1_gqaratio16_msk0_lse_psE,mla_a8w8_qh16_qseqlen1_gqaratio16_msk0_lse_ps.co
fp8,fp8,16,1,4,0,0,0,0,_ZN5aiter44mla_a8w8_qh16_qseqlen4_gqaratio16_msk0_v3_psE,mla_a8w8_qh16_qseqlen4_gqaratio16_msk0_v3_ps.co
fp8,fp8,16,1,4,0,0,0,1,_ZN5aiter49mla_a8w8_qh16_qseqlen4_gqaratio16_msk0_cprr_v3_psE,mla_a8w8_qh16_qseqlen4_gqaratio16_msk0_cprr_v3_ps.co
fp8,fp8,16,1,4,0,0,1,0,_ZN5aiter48mla_a8w8_qh16_qseqlen4_gqaratio16_msk0_lse_v3_psE,mla_a8w8_qh16_qseqlen4_gqaratio16_msk0_lse_v3_ps.co
fp8,fp8,16,1,4,0,0,1,1,_ZN5aiter53mla_a8w8_qh16_qseqlen4_gqaratio16_msk0_lse_cprr_v3_psE,mla_a8w8_qh16_qseqlen4_gqaratio16_msk0_lse_cprr_v3_ps.co
fp8,fp8,32,1,4,0,0,0,0,_ZN5aiter41mla_a8w8_qh32_qseqlen4_gqaratio32_msk0_psE,mla_a8w8_qh32_qseqlen4_gqaratio32_msk0_ps.co
fp8,fp8,32,1,4,0,0,0,1,_ZN5aiter46mla_a8w8_qh32_qseqlen4_gqaratio32_msk0_cprr_psE,mla_a8w8_qh32_qseqlen4_gqaratio32_msk0_cprr_ps.co
fp8,fp8,32,1,4,0,0,1,0,_ZN5aiter45mla_a8w8_qh32_qseqlen4_gqaratio32_msk0_lse_psE,mla_a8w8_qh32_qseqlen4_gqaratio32_msk0_lse_ps.co
fp8,fp8,32,1,4,0,0,1,1,_ZN5aiter50mla_a8w8_qh32_qseqlen4_gqaratio32_msk0_lse_cprr_psE,mla_a8w8_qh32_qseqlen4_gqaratio32_msk0_lse_cprr_ps.co
fp8,fp8,128,0,0,0,0,0,0,_ZN5aiter31mla_a8w8_qh128_m32x4_n16x2_msk0E,mla_a8w8_qh128_m32x4_n16x2_msk0.co
""",
}

F8 = {"gfx942": jnp.float8_e4m3fnuz, "gfx950": jnp.float8_e4m3fn}


def write_hsa(root, tables=None):
    """A fake AITER ``hsa`` directory: ``{arch: csv text}`` (default: the pinned tables)."""
    for arch, text in (tables or PINNED_CSV).items():
        d = root / arch / "mla"
        d.mkdir(parents=True, exist_ok=True)
        (d / "mla_asm.csv").write_text(text)
    return root


def edit_csv(text, drop=(), add=()):
    """``text`` without the rows whose ``knl_name`` is in ``drop``, with the rows ``add``."""
    lines = text.strip().splitlines()
    kept = [ln for ln in lines[1:] if ln.split(",")[-2] not in drop]
    assert len(lines) - 1 - len(kept) == len(drop), f"not all of {drop} are rows"
    return "\n".join([lines[0], *kept, *add]) + "\n"


@pytest.fixture
def installed(tmp_path, monkeypatch):
    """Install ``{arch: csv text}`` (default: the pinned tables) as AITER_ASM_DIR."""
    def install(tables=None, name="hsa"):
        root = write_hsa(tmp_path / name, tables)
        monkeypatch.setenv("AITER_ASM_DIR", str(root))
        return root

    return install


def _md(arch, heads, qlen, kv="bf16", k=None, return_lse=False, **kw):
    kv_dtype = F8[arch] if kv == "fp8" else jnp.bfloat16
    return build_aiter_decode_metadata(jnp.zeros((2, 4), jnp.int32), jnp.array([5, 9]),
                                       page_size=4, num_heads=heads, qlen=qlen,
                                       kv_dtype=kv_dtype, arch=arch, num_cu=8,
                                       mtp_decode_qlen=k, return_lse=return_lse, **kw)


def _diff(got: dict, want: dict) -> list:
    keys = sorted(set(got) | set(want), key=repr)
    return [(k, got.get(k, "absent"), want.get(k, "absent")) for k in keys
            if got.get(k, "absent") != want.get(k, "absent")]


# --- the static tables are the pinned csv's -----------------------------------------------------

@pytest.mark.parametrize("arch", caps.ARCHES)
def test_static_table_equals_the_table_derived_from_the_pinned_csv(tmp_path, arch):
    root = write_hsa(tmp_path / "hsa")
    table = native.kernel_table(arch, str(root))
    derived = native.kernel_set_from_table(table, arch)
    assert derived.installed and derived.arch == arch and table.path in derived.source
    facts = native.kernel_facts(table, arch)
    # the rows state exactly the csv's facts (the compression loses nothing) ...
    assert _diff(caps.asm_kernel_facts(derived.rows), facts) == []
    # ... and the static table states the same facts: (shape, static, csv) where they differ
    static = caps.asm_kernel_facts(caps.ASM_KERNELS[arch])
    assert _diff(static, facts) == []
    # every LSE fact of the static table is known (the csv settles each one)
    assert None not in static.values()
    assert all(row.lse is not None for row in caps.ASM_KERNELS[arch])


def test_the_derived_rows_have_the_static_tables_form(tmp_path):
    root = write_hsa(tmp_path / "hsa")
    rows = native.kernel_set_from_table(native.kernel_table("gfx950", str(root)), "gfx950").rows
    # gfx950 bf16 persistent: every head count >= 16, any qlen, with LSE (the generic kernels)
    assert caps.AsmKernelRow("bf16", "bf16", None, None, True, True) in rows
    assert caps.AsmKernelRow("fp8", "fp8", (16,), (2,), True, False) in rows
    assert caps.AsmKernelRow("bf16", "bf16", (16,), tuple(range(1, 9)), False, True) in rows


# --- detection ----------------------------------------------------------------------------------

def test_plans_use_the_installed_kernel_set_derived_once_per_installation(installed,
                                                                          monkeypatch):
    root = installed()
    calls = []
    real = native.kernel_facts
    monkeypatch.setattr(native, "kernel_facts", lambda *a: calls.append(a) or real(*a))
    md = _md("gfx942", 16, 1)
    md2 = _md("gfx942", 128, 2)
    ks = md.plan.route.asm_kernels
    assert ks.installed and ks.arch == "gfx942"
    assert str(root / "gfx942" / "mla" / "mla_asm.csv") in ks.source
    assert md2.plan.route.asm_kernels is ks and md.plan.build.asm_kernels is ks
    assert native.installed_kernel_set("gfx942") is ks
    assert len(calls) == 1
    assert _md("gfx950", 16, 1).plan.route.asm_kernels.arch == "gfx950"
    assert len(calls) == 2


def test_without_an_installation_the_static_table_is_used_and_says_so(monkeypatch):
    monkeypatch.delenv("AITER_ASM_DIR", raising=False)
    monkeypatch.setattr(native, "asm_dir", lambda: None)
    md = _md("gfx942", 16, 1)
    ks = md.plan.route.asm_kernels
    assert not ks.installed and ks.rows is caps.ASM_KERNELS["gfx942"]
    assert "static table" in ks.source and "e4048607" in ks.source
    assert "no installed AITER hsa directory" in ks.source
    # the pure functions, given no kernel set, use the static table too
    r = caps.decide_route(arch="gfx950", num_heads=16, qlen=1, q_dtype="bf16", kv_dtype="bf16")
    assert not r.asm_kernels.installed and r.asm_kernels.rows is caps.ASM_KERNELS["gfx950"]


def test_an_unreadable_installed_table_falls_back_to_the_static_one_with_a_warning(installed):
    installed({"gfx950": PINNED_CSV["gfx950"].replace("qSeqLen", "qlen")}, name="odd")
    with pytest.warns(RuntimeWarning, match="static table of ROCm/aiter e4048607.*is not the one"):
        md = _md("gfx950", 16, 1)
    ks = md.plan.route.asm_kernels
    assert not ks.installed and "could not be read" in ks.source
    with warnings.catch_warnings(record=True) as rec:
        warnings.simplefilter("always")
        _md("gfx950", 16, 1)  # warned once per table
    assert not [w for w in rec if "static table" in str(w.message)]
    # an arch the installation has no table for: the static table, also said
    with pytest.warns(RuntimeWarning, match="does not exist"):
        assert not _md("gfx942", 16, 1).plan.route.asm_kernels.installed


def test_a_given_kernel_set_is_used_as_is(installed, tmp_path):
    installed()  # the pinned set is installed; the given one lacks gfx942's only persistent LSE
    lse_row = "_ZN5aiter43mla_a8w8_qh64_qseqlen1_gqaratio64_lse_v3_psE"
    other = write_hsa(tmp_path / "other",
                      {"gfx942": edit_csv(PINNED_CSV["gfx942"], drop=[lse_row])})
    given = native.kernel_set_from_table(native.kernel_table("gfx942", str(other)), "gfx942")
    build = caps.AiterBuild(asm_kernels=given)
    with pytest.raises(NotImplementedError, match="that returns an LSE in the installed"):
        _md("gfx942", 64, 1, kv="fp8", return_lse=True, build=build)
    assert _md("gfx942", 64, 1, kv="fp8", return_lse=True).plan.route.persistent
    with pytest.raises(ValueError, match="asm kernel set is gfx942's.*plan is for gfx950"):
        _md("gfx950", 16, 1, build=build)


# --- a kernel set that differs from the pinned one ----------------------------------------------

def test_removing_a_kernel_row_raises_an_error_naming_the_kernel(installed):
    lse_row = "_ZN5aiter43mla_a8w8_qh64_qseqlen1_gqaratio64_lse_v3_psE"
    assert _md("gfx942", 64, 1, kv="fp8", return_lse=True).plan.route.persistent  # pinned: ok
    root = installed({"gfx942": edit_csv(PINNED_CSV["gfx942"], drop=[lse_row])}, name="less")
    path = str(root / "gfx942" / "mla" / "mla_asm.csv")
    with pytest.raises(NotImplementedError) as e:
        _md("gfx942", 64, 1, kv="fp8", return_lse=True)
    msg = str(e.value)
    for part in ("AITER on gfx942", "no persistent asm MLA decode kernel", "q fp8 / kv fp8",
                 "64 heads", "qlen 1", "that returns an LSE", path,
                 "ROCm/aiter e4048607 has this kernel"):
        assert part in msg, (part, msg)
    # the same shape without the LSE still has its kernel
    assert _md("gfx942", 64, 1, kv="fp8").plan.route.persistent


def test_removing_a_split_kv_row_refuses_the_split_kv_route(installed):
    mtp = "_ZN5aiter39mla_a16w16_qh16_m16x4_n16x1_coex0_mask1E"  # split-KV bf16 16 heads qlen<=4
    r = _md("gfx950", 16, 2, k=1).plan.route  # qlen > K: split-KV
    assert r.kind == "asm" and not r.persistent
    installed({"gfx950": edit_csv(PINNED_CSV["gfx950"], drop=[mtp])}, name="less")
    with pytest.raises(NotImplementedError,
                       match=r"gfx950 has no non-persistent .* q bf16 / kv bf16, 16 heads, qlen 2"):
        _md("gfx950", 16, 2, k=1)
    assert _md("gfx950", 16, 1).plan.route.persistent  # other routes are unaffected


def test_adding_a_kernel_row_enables_a_route(installed):
    # gfx942: vLLM's gate makes bf16 MTP with qlen 8 persistent, and e4048607 has no kernel
    with pytest.raises(NotImplementedError, match="16 heads, qlen 8 in the installed"):
        installed()
        _md("gfx942", 16, 8, k=8)
    qseqlen8_ps = ("bf16,bf16,16,1,8,0,1,0,_ZN5aiter42mla_a16w16_qh16_m32x4_n16x1_coex0_mask1_psE,"
                   "mla_a16w16_qh16_m32x4_n16x1_coex0_mask1_ps.co")
    installed({"gfx942": edit_csv(PINNED_CSV["gfx942"], add=[qseqlen8_ps])}, name="more")
    r = _md("gfx942", 16, 8, k=8).plan.route
    assert r.kind == "asm" and r.persistent and r.asm_kernels.installed
    assert _md("gfx942", 128, 8, k=8).plan.route.persistent  # folded to 16-head pseudo-batches
    assert caps.asm_kernel_available("gfx942", "bf16", "bf16", 16, 8, persistent=True,
                                     kernels=r.asm_kernels)
    assert not caps.asm_kernel_available("gfx942", "bf16", "bf16", 16, 8, persistent=True)


def test_adding_an_lse_variant_enables_dcp_decode_in_bf16_on_gfx942(installed):
    with pytest.raises(NotImplementedError, match="that returns an LSE"):
        installed()
        _md("gfx942", 32, 1, return_lse=True)
    lse_ps = ("bf16,bf16,16,1,4,0,1,1,_ZN5aiter46mla_a16w16_qh16_m16x4_n16x1_coex0_mask1_lse_psE,"
              "mla_a16w16_qh16_m16x4_n16x1_coex0_mask1_lse_ps.co")  # gfx950 ships this one
    installed({"gfx942": edit_csv(PINNED_CSV["gfx942"], add=[lse_ps])}, name="more")
    r = _md("gfx942", 32, 1, return_lse=True).plan.route
    assert r.persistent and r.return_lse and r.asm_kernels.installed
