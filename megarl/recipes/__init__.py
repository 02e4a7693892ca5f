"""Example user code that recipes (configs/*.yaml) name by `module:function`: written as a user would write it
outside megarl."""
