package simlonghorn

import (
	"context"
	"fmt"
	"slices"
	"testing"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
)

type deviceCalls struct{ calls []string }

func (d *deviceCalls) DeviceGone(_ context.Context, volume, node string, holders []Holder) {
	var hs []string
	for _, h := range holders {
		hs = append(hs, h.Pod.Name+":"+h.Volume)
	}
	d.calls = append(d.calls, fmt.Sprintf("gone %s %s %v", volume, node, hs))
}

func (d *deviceCalls) DeviceBack(_ context.Context, volume, node string) {
	d.calls = append(d.calls, fmt.Sprintf("back %s %s", volume, node))
}

func claimPod(name, node, claim string) corev1.Pod {
	return corev1.Pod{
		ObjectMeta: metav1.ObjectMeta{Name: name, Namespace: "guests"},
		Spec: corev1.PodSpec{NodeName: node, Volumes: []corev1.Volume{{Name: "disk-" + claim, VolumeSource: corev1.VolumeSource{
			PersistentVolumeClaim: &corev1.PersistentVolumeClaimVolumeSource{ClaimName: claim}}}}},
	}
}

// A fault takes the device from every node an engine of the volume ran on
// (the migration's too), under the pods there that use its claim; an
// engine that comes up on a node brings it back there. A repeated fault
// tells nothing new.
func TestFaultTellsTheDevicesGoneAndAttachBringsThemBack(t *testing.T) {
	hook := &deviceCalls{}
	s := bareSim(Options{Scale: 1, Devices: hook})
	p := &pass{pods: map[string][]corev1.Pod{"guests": {
		claimPod("hp-a", "host-a", "claim"), claimPod("hp-b", "host-b", "claim"),
		claimPod("hp-c", "host-c", "claim"), claimPod("other", "host-a", "another"),
	}}}
	attached := &Volume{ObjectMeta: metav1.ObjectMeta{Name: "vol"}, Status: VolumeStatus{
		State: VolumeStateAttached, Robustness: VolumeRobustnessHealthy, CurrentNodeID: "host-a", CurrentMigrationNodeID: "host-b",
		KubernetesStatus: KubernetesStatus{Namespace: "guests", PVCName: "claim"},
	}}
	faulted := clone(attached)
	faulted.Status.State, faulted.Status.Robustness = VolumeStateDetached, VolumeRobustnessFaulted
	faulted.Status.CurrentNodeID, faulted.Status.CurrentMigrationNodeID = "", ""
	back := clone(attached)
	back.Status.CurrentMigrationNodeID = ""

	s.tellDevices(context.Background(), p, attached, faulted)
	s.tellDevices(context.Background(), p, faulted, faulted)
	s.tellDevices(context.Background(), p, faulted, back)
	s.tellDevices(context.Background(), p, back, back)
	want := []string{"gone vol host-a [hp-a:disk-claim]", "gone vol host-b [hp-b:disk-claim]", "back vol host-a"}
	if !slices.Equal(hook.calls, want) {
		t.Errorf("device calls %q, want %q", hook.calls, want)
	}
}
