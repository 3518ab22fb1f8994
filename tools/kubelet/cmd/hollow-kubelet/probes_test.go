package main

import (
	"context"
	"testing"

	v1 "k8s.io/api/core/v1"
)

// A container still waiting (for its volumes, say) is neither started nor
// ready; one that runs is both; a finished init container is ready, a
// sidecar only while it runs.
func TestContainerReadyOnlyOnceItRuns(t *testing.T) {
	always := v1.ContainerRestartPolicyAlways
	pod := &v1.Pod{Spec: v1.PodSpec{InitContainers: []v1.Container{{Name: "init"}, {Name: "sidecar", RestartPolicy: &always}}}}
	st := &v1.PodStatus{
		ContainerStatuses: []v1.ContainerStatus{
			{Name: "waiting", State: v1.ContainerState{Waiting: &v1.ContainerStateWaiting{Reason: "ContainerCreating"}}},
			{Name: "running", State: v1.ContainerState{Running: &v1.ContainerStateRunning{}}},
		},
		InitContainerStatuses: []v1.ContainerStatus{
			{Name: "init", State: v1.ContainerState{Terminated: &v1.ContainerStateTerminated{ExitCode: 0}}},
			{Name: "sidecar", State: v1.ContainerState{Waiting: &v1.ContainerStateWaiting{}}},
		},
	}
	probes{}.UpdatePodStatus(context.Background(), pod, st)
	for _, c := range []struct {
		got  v1.ContainerStatus
		want bool
	}{{st.ContainerStatuses[0], false}, {st.ContainerStatuses[1], true}, {st.InitContainerStatuses[0], true}, {st.InitContainerStatuses[1], false}} {
		if c.got.Ready != c.want {
			t.Errorf("container %s in %+v: ready %v, want %v", c.got.Name, c.got.State, c.got.Ready, c.want)
		}
	}
	if s := st.ContainerStatuses[0].Started; s == nil || *s {
		t.Errorf("waiting container started = %v, want false", s)
	}
}
