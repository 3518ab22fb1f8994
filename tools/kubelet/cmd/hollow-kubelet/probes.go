package main

import (
	"context"

	v1 "k8s.io/api/core/v1"
	probetest "k8s.io/kubernetes/pkg/kubelet/prober/testing"
)

// probes is kubemark's fake prober with the readiness a kubelet gives a
// container that has no probes: started and ready once it runs, not
// before. Kubemark's fake marks every container ready at once, even one
// still waiting for its volumes (kubernetes v1.35.4
// pkg/kubelet/prober/testing/fake_manager.go), so a pod whose volume never
// mounts would still be reported Ready. The rules are the real prober's
// for containers without probes (pkg/kubelet/prober/prober_manager.go
// UpdatePodStatus); no probe ever runs, as the containers have nothing to
// answer one.
type probes struct {
	probetest.FakeManager
}

func (probes) UpdatePodStatus(_ context.Context, pod *v1.Pod, st *v1.PodStatus) {
	for i := range st.ContainerStatuses {
		c := &st.ContainerStatuses[i]
		running := c.State.Running != nil
		c.Started = &running
		c.Ready = running
	}
	for i := range st.InitContainerStatuses {
		c := &st.InitContainerStatuses[i]
		running := c.State.Running != nil
		c.Started = &running
		if restartable(pod, c.Name) {
			c.Ready = running // a sidecar is ready while it runs
			continue
		}
		c.Ready = c.State.Terminated != nil && c.State.Terminated.ExitCode == 0
	}
}

// restartable reports whether init container name is a sidecar
// (restartPolicy Always).
func restartable(pod *v1.Pod, name string) bool {
	for _, c := range pod.Spec.InitContainers {
		if c.Name == name {
			return c.RestartPolicy != nil && *c.RestartPolicy == v1.ContainerRestartPolicyAlways
		}
	}
	return false
}
