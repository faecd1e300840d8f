"""The manager's engine: private, used by :class:`scalestate.ScalingStateManager` only.

Nothing here is public API; names and behaviour may change in any release.
What each module holds, so that a reader of the manager can find it:

``control``
    The phase API's code (``begin_*()``, the phase blocks, ``step()``,
    ``discard_step()``), a base of the manager that documents it as its own.
``state``
    :class:`~scalestate._engine.state.State`, the one mutable object behind a
    manager: the slot buffers (scales, amax histories, accumulators), which
    grow by capacity doubling and never move after the first step, and the
    step bookkeeping (iteration, scale epoch, phase stack).
``casting``
    The cast path: classify each cast (record, recompute, evaluation), pick
    its scale and record target, call the backend inside
    :func:`scalestate.sac.hidden_from_sac`.
``grouped_rows``
    Compiled grouped casts with the group sizes on the device: one graph for
    every routing of a mixture-of-experts layer.
``cache``
    The weight-cast cache: one cast per (weight, version, scale epoch).
``binding``
    Which backend a manager uses, on which device; settled once, then fixed.
``loading``
    Every check a saved state passes before :meth:`load_state_dict` changes
    anything (the format itself is the public :mod:`scalestate.persist`).
``stepping``
    The end of a step: checks, the one cross-rank reduction, the non-finite
    policy, the backend's fused update.
``counting``
    What one recorded cast did to its elements (clipped, flushed to zero),
    counted on the device for ``collect_stats=True``.
``stepwatch``
    Notices a forgotten ``manager.step()`` (the ``no-step`` risk flag and the
    one-time :class:`~scalestate.errors.MissingStepWarning`).
``debug``
    Debug mode's recompute check (every recompute must reproduce an amax its
    forward observed).
"""
