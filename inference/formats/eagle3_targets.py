"""The target architectures serving engines run an EAGLE-3 drafter on.

An EAGLE-3 drafter reads hidden states the target model must capture while it runs; an engine whose class for the
target's architecture cannot capture them refuses to start. Read from the engines' released code:

* vLLM {VLLM} (``vllm/model_executor/models/registry.py`` and each model class's ``SupportsEagle3``): an
  architecture vLLM implements natively without ``SupportsEagle3`` is refused for ``method: eagle3``; one it has no
  native class for runs on its Transformers backend, which captures them (``models/transformers/base.py``
  ``set_aux_hidden_state_layers``). So vLLM is listed by the architectures it refuses.
* SGLang {SGLANG} (``srt/model_executor/model_runner_components/attention_backend_setup.py``): a target class
  without ``set_eagle3_layers_to_capture`` raises ``ValueError`` (its Transformers fallback has none either). So
  SGLang is listed by the architectures it runs (the class or one it derives from defines the method).

Regenerate both when a newer release changes them; the export says which release it checked.

Older vLLM releases also gated ``method: eagle3`` on the target's text-config ``model_type``: 0.9.0 to 0.21.0
refused one that holds none of a list of substrings (``SpeculativeConfig``, ``vllm/config/speculative.py``:
``any(s in hf_text_config.model_type for s in aux_hidden_states_supported)``, 0.21.0 lines 974-1002; 0.9.0-0.10.0
``"llama" not in model_type``, ``vllm/config.py``). Read from each release's source archive; 0.22.0 dropped it.
"""

from __future__ import annotations

from typing import Optional

VLLM = "0.34.0"
SGLANG = "0.5.23"

# native vLLM {VLLM} text / multimodal generation classes without SupportsEagle3
VLLM_REFUSES = frozenset({
    "AXK1ForCausalLM", "AliceAIForCausalLM", "AudioFlamingo3ForConditionalGeneration",
    "BagelForConditionalGeneration", "BailingMoeForCausalLM", "BailingMoeV2ForCausalLM",
    "BailingMoeV2_5ForCausalLM", "BailingMoeV3ForCausalLM", "BailingMoeV3VLForConditionalGeneration",
    "BeamForCausalLM", "BeeForConditionalGeneration", "Blip2ForConditionalGeneration", "BloomForCausalLM",
    "CanaryForConditionalGeneration", "ChatGLMForConditionalGeneration", "Cohere2ForCausalLM",
    "Cohere2VisionForConditionalGeneration", "CohereAsrForConditionalGeneration", "CohereForCausalLM",
    "Cosmos3EdgeForConditionalGeneration", "DbrxForCausalLM", "DeciLMForCausalLM", "DeepseekOCR2ForCausalLM",
    "DeepseekOCRForCausalLM", "DeepseekV32ForCausalLM", "DeepseekV41ForCausalLM", "DeepseekV4ForCausalLM",
    "DeepseekV4ForConditionalGeneration", "DeepseekVLV2ForCausalLM", "DomynEdgeForCausalLM", "DoryForCausalLM",
    "Dots3NoteForCausalLM", "DotsOCRForCausalLM", "Eagle2_5_VLForConditionalGeneration",
    "Ernie4_5_MoeForCausalLM", "Ernie4_5_VLMoeForConditionalGeneration", "Exaone4ForCausalLM",
    "ExaoneForCausalLM", "ExaoneMoEForCausalLM", "ExaoneMoeForCausalLM", "FalconForCausalLM",
    "FalconH1ForCausalLM", "FalconMambaForCausalLM", "FireRedASR2ForConditionalGeneration", "FlintForCausalLM",
    "FunASRForConditionalGeneration", "FunAudioChatForConditionalGeneration", "GLM4VForCausalLM",
    "GPTJForCausalLM", "Gemma2ForCausalLM", "Gemma3ForCausalLM", "Gemma3ForConditionalGeneration",
    "Gemma3nForCausalLM", "Gemma3nForConditionalGeneration", "Glm4ForCausalLM", "Glm4MoeForCausalLM",
    "Glm4MoeLiteForCausalLM", "Glm4vForConditionalGeneration", "Glm4vMoeForConditionalGeneration",
    "Glm5NextForCausalLM", "Glm5NextForConditionalGeneration", "GlmAsrForConditionalGeneration",
    "GlmMoeDsaForCausalLM", "GlmOcrForConditionalGeneration", "Granite4VisionForConditionalGeneration",
    "GraniteMoeHybridForCausalLM", "GraniteSpeechForConditionalGeneration",
    "GraniteSpeechPlusForConditionalGeneration", "HCXVisionV2ForCausalLM", "HYV3ForCausalLM", "HYV4ForCausalLM",
    "HrmTextForCausalLM", "HyperCLOVAXForCausalLM", "IQuestLoopCoderForCausalLM",
    "Idefics3ForConditionalGeneration", "InklingForCausalLM", "InklingForConditionalGeneration",
    "InternLM2ForCausalLM", "InternS1ForConditionalGeneration", "InternVLForConditionalGeneration",
    "IsaacForConditionalGeneration", "JambaForCausalLM", "KananaVForConditionalGeneration",
    "KimiK31ForConditionalGeneration", "KimiK3ForConditionalGeneration", "KimiLinearForCausalLM",
    "KimiVLForConditionalGeneration", "Lfm2ForCausalLM", "Lfm2MoeForCausalLM", "Lfm2VlForConditionalGeneration",
    "Lfm3AudioForConditionalGeneration", "Lfm3ForCausalLM", "Lfm3VlForConditionalGeneration",
    "LlavaNextForConditionalGeneration", "LlavaNextVideoForConditionalGeneration",
    "LlavaOnevision2ForConditionalGeneration", "LlavaOnevisionForConditionalGeneration",
    "LongcatFlashForCausalLM", "LongcatFlashNgramForCausalLM", "Mamba2ForCausalLM", "MambaForCausalLM",
    "MingV3ASRForConditionalGeneration", "MiniMaxM3SparseForCausalLM", "MiniMaxM3SparseForConditionalGeneration",
    "MistralLarge4ForCausalLM", "MixtralForCausalLM", "Molmo2ForConditionalGeneration", "MolmoForCausalLM",
    "Moondream3ForCausalLM", "MoonshotKimiaForCausalLM", "MossTranscribeDiarizeForConditionalGeneration",
    "MuseSparkForConditionalGeneration", "NemotronForCausalLM", "NemotronParseForConditionalGeneration",
    "OPTForCausalLM", "OlmoHybridForCausalLM", "OpenPanguVLForConditionalGeneration", "OrionForCausalLM",
    "Ovis2_6ForCausalLM", "Ovis2_6_MoeForCausalLM", "PaddleOCRVLForConditionalGeneration",
    "PaliGemmaForConditionalGeneration", "PanguEmbeddedForCausalLM", "PanguProMoEV2ForCausalLM",
    "PanguUltraMoEForCausalLM", "Param2MoEForCausalLM", "Phi3VForCausalLM", "Phi4MMForCausalLM",
    "PhiMoEForCausalLM", "QianfanOCRForConditionalGeneration", "Qwen2AudioForConditionalGeneration",
    "Qwen2MoeForCausalLM", "Qwen2VLForConditionalGeneration", "Qwen2_5OmniForConditionalGeneration",
    "Qwen4ExpForCausalLM", "Qwen4ExpForConditionalGeneration", "RForConditionalGeneration", "Rnj1ForCausalLM",
    "SarvamMoEForCausalLM", "SmolVLMForConditionalGeneration", "SolarForCausalLM", "Step3TextForCausalLM",
    "Step3VLForConditionalGeneration", "Step3p5ForCausalLM", "Step3p7ForConditionalGeneration",
    "Step5ForCausalLM", "Step5ForConditionalGeneration", "StepVLForConditionalGeneration",
    "UnlimitedOCRForCausalLM", "VoxtralForConditionalGeneration", "WhisperForConditionalGeneration",
    "Zamba2ForCausalLM", "ZayaForCausalLM"
})

# SGLang {SGLANG} entry classes that define (or inherit) set_eagle3_layers_to_capture
SGLANG_RUNS = frozenset({
    "ApertusForCausalLM", "BailingMoEForCausalLM", "BailingMoeForCausalLM", "BailingMoeV2ForCausalLM",
    "Cosmos3ForConditionalGeneration", "DeepseekV2ForCausalLM", "DeepseekV32ForCausalLM", "DeepseekV3ForCausalLM",
    "ExaoneMoEForCausalLM", "ExaoneMoeForCausalLM", "Gemma3ForCausalLM", "Gemma3ForConditionalGeneration",
    "Gemma4ForCausalLM", "Gemma4ForConditionalGeneration", "Gemma4UnifiedForConditionalGeneration",
    "Glm4MoeForCausalLM", "Glm4MoeLiteForCausalLM", "Glm5NextForConditionalGeneration", "GlmMoeDsaForCausalLM",
    "GptOssForCausalLM", "IQuestCoderForCausalLM", "InternLM3ForCausalLM", "InternS1ProForConditionalGeneration",
    "InternS2MobiusForConditionalGeneration", "InternS2PreviewForConditionalGeneration",
    "KimiK25ForConditionalGeneration", "Llama4ForCausalLM", "Llama4ForConditionalGeneration", "LlamaForCausalLM",
    "LongcatFlashForCausalLM", "MellumForCausalLM", "MindSporeForCausalLM", "MiniMaxM2ForCausalLM",
    "MiniMaxM3SparseForCausalLM", "MiniMaxM3SparseForConditionalGeneration", "Ministral3ForCausalLM",
    "MistralForCausalLM", "MistralLarge3ForCausalLM", "Phi3ForCausalLM", "Qwen2ForCausalLM",
    "Qwen2MoeForCausalLM", "Qwen2_5_VLForConditionalGeneration", "Qwen3ForCausalLM", "Qwen3MoeForCausalLM",
    "Qwen3NextForCausalLM", "Qwen3VLForConditionalGeneration", "Qwen3VLMoeForConditionalGeneration",
    "Qwen3_5ForCausalLM", "Qwen3_5ForConditionalGeneration", "Qwen3_5MoeForCausalLM",
    "Qwen3_5MoeForConditionalGeneration", "Qwen4ExpForConditionalGeneration", "SarvamMoEForCausalLM",
    "TeleFLMForCausalLM"
})


# (the last vLLM release with this list, the list): every release from 0.9.0 to 0.21.0, each list its
# predecessor's plus the release's additions
_VLLM_MODEL_TYPE_GATES = (
    ("0.10.0", ("llama",)),
    ("0.10.2", ("qwen",)),
    ("0.15.1", ("minicpm", "gpt_oss")),
    ("0.16.0", ("hunyuan_vl", "hunyuan_v1_dense", "afmoe")),
    ("0.17.1", ("nemotron_h",)),
    ("0.19.0", ("deepseek_v2", "deepseek_v3", "kimi_k2", "kimi_k25")),
    ("0.20.2", ("minimax_m2", "gemma4")),
    ("0.21.0", ("laguna",)),
)


def vllm_releases_gating(model_type: Optional[str]) -> Optional[str]:
    """The vLLM releases ("0.9.0-0.21.0") whose model_type gate refuses an EAGLE-3 drafter for a target of text-config
    ``model_type`` (module docstring), or None (every release takes it, or the type is unknown)."""
    if not model_type:
        return None
    listed, last_refusing = [], None
    for last, added in _VLLM_MODEL_TYPE_GATES:
        listed += added
        if not any(s in model_type for s in listed):
            last_refusing = last
    return f"0.9.0-{last_refusing}" if last_refusing else None


def engines_refusing(architecture: Optional[str]) -> dict[str, str]:
    """Engine name -> why it would not start an EAGLE-3 drafter for a target of ``architecture`` ({} when both would,
    or the architecture is unknown)."""
    if not architecture:
        return {}
    out = {}
    if architecture in VLLM_REFUSES:
        out["vLLM"] = f"vLLM {VLLM}'s {architecture} does not implement SupportsEagle3"
    if architecture not in SGLANG_RUNS:
        out["SGLang"] = f"SGLang {SGLANG}'s {architecture} does not implement set_eagle3_layers_to_capture"
    return out
