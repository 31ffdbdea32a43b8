"""Capture the Dynamo FX graph of a model's forward: the same graph the lrkv backend will see."""
import torch


def capture(model, input_ids: torch.Tensor):
    """Trace `model.forward(input_ids=..., use_cache=False)` with Dynamo; returns (graph module, example
    inputs, index of input_ids among them, name_of) where name_of maps a placeholder to its parameter name."""
    captured = []

    def keep_graph(gm, example_inputs, **_):
        captured.append((gm, list(example_inputs)))
        return gm.forward

    compiled = torch.compile(model.forward, backend=keep_graph, fullgraph=True, dynamic=False)
    with torch.no_grad():
        compiled(input_ids=input_ids, use_cache=False)
    if len(captured) != 1:
        raise RuntimeError(f"expected one graph from the model's forward, Dynamo produced {len(captured)}")
    gm, example_inputs = captured[0]
    names = {id(tensor): name for name, tensor in list(model.named_parameters()) + list(model.named_buffers())}
    placeholders = [node for node in gm.graph.nodes if node.op == "placeholder"]
    by_node = {node: names.get(id(value)) for node, value in zip(placeholders, example_inputs)}
    ids_index = next(i for i, value in enumerate(example_inputs) if value is input_ids)
    return gm, example_inputs, ids_index, by_node.get
