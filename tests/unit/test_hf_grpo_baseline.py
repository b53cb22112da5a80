"""`verl bench train --baseline hf` computes log-probs the way the peers do (issue 57 item 5): the output layer on
the response positions only and no full-vocabulary log-softmax, giving what the full computation gives."""

import torch
import transformers

from verl.bench.hf_grpo import response_log_probs


def test_response_log_probs_are_the_full_log_softmax_at_the_response_positions():
    torch.manual_seed(0)
    cfg = transformers.Qwen2Config(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                                   num_key_value_heads=2, vocab_size=97, max_position_embeddings=64)
    model = transformers.Qwen2ForCausalLM(cfg).float()
    prompt_len, response_len = 7, 5
    sequences = torch.randint(0, 97, (3, prompt_len + response_len))
    attention = torch.ones_like(sequences)
    attention[0, :2] = 0  # a left-padded prompt
    positions = torch.clamp(torch.cumsum(attention, dim=1) - 1, min=0)
    responses = sequences[:, prompt_len:]
    ours = response_log_probs(model, sequences, attention, positions, responses)
    logits = model(input_ids=sequences, attention_mask=attention, position_ids=positions).logits
    full = torch.log_softmax(logits[:, prompt_len - 1:-1].float(), dim=-1).gather(-1, responses.unsqueeze(-1))
    # fp32, a 97-wide log-sum-exp and 2 layers: the two orders of summation agree to a few ulps of the log-probs.
    torch.testing.assert_close(ours, full.squeeze(-1), rtol=0, atol=1e-5)
    ours.sum().backward()  # the update's loss differentiates through it
    assert all(p.grad is not None for p in model.parameters() if p.requires_grad)
