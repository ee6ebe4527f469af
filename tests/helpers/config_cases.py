"""AFD configs the config tests share: the wrapped `{"afd": ...}` shape with every alias."""

WRAPPED = {
    "afd": {
        "afd_role": "ffn",
        "afd_connector": "GpuAsyncAFDConnector",
        "afd_host": "10.0.0.2",
        "afd_port": 7000,
        "num_attention_ranks": 3,
        "num_ffn_ranks": 2,
        "connector_extra_config": {"ring_depth": 2},
    }
}
