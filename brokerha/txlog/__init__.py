"""brokerha.txlog"""
