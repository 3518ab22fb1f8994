package diagnose

import (
	"slices"
	"strings"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	storagev1 "k8s.io/api/storage/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/utils/ptr"
	kubevirtv1 "kubevirt.io/api/core/v1"
)

func inUse(vol string) corev1.UniqueVolumeName {
	return corev1.UniqueVolumeName("kubernetes.io/csi/" + drv + "^" + vol)
}

// launcher is a VM's virt-launcher pod, controlled by its VMI.
func launcher(name, vm string) corev1.Pod {
	return corev1.Pod{ObjectMeta: metav1.ObjectMeta{Name: name, Labels: map[string]string{kubevirtAppLabel: launcherPodApp},
		OwnerReferences: []metav1.OwnerReference{{Kind: "VirtualMachineInstance", Name: vm, Controller: ptr.To(true)}}},
		Status: corev1.PodStatus{Phase: corev1.PodRunning}}
}

// attachmentPod is KubeVirt's hp-volume pod, controlled by the launcher pod.
func attachmentPod(name, owner string, phase corev1.PodPhase, claims ...string) corev1.Pod {
	p := corev1.Pod{ObjectMeta: metav1.ObjectMeta{Name: name, Labels: map[string]string{kubevirtAppLabel: attachmentPodApp},
		OwnerReferences: []metav1.OwnerReference{{Kind: "Pod", Name: owner, Controller: ptr.To(true)}}},
		Status: corev1.PodStatus{Phase: phase}}
	for _, c := range claims {
		p.Spec.Volumes = append(p.Spec.Volumes, corev1.Volume{Name: c, VolumeSource: corev1.VolumeSource{
			PersistentVolumeClaim: &corev1.PersistentVolumeClaimVolumeSource{ClaimName: c}}})
	}
	return p
}

func claimIn(name string, phase corev1.PersistentVolumeClaimPhase, created time.Time) corev1.PersistentVolumeClaim {
	c := hostClaim(name, "lh-"+name)
	c.Status.Phase, c.CreationTimestamp = phase, metav1.NewTime(created)
	return c
}

// TestHostSideFindings fabricates each host-side finding next to the same
// states while they are young or explained, which are quiet.
func TestHostSideFindings(t *testing.T) {
	now := time.Now()
	old, young := now.Add(-time.Hour), now.Add(-time.Second)
	stuck := attachmentPod("hp-volume-stuck", "virt-launcher-vm-a-x", corev1.PodPending, "pvc-held")
	stuck.CreationTimestamp = metav1.NewTime(old)
	stuck.Status.Conditions = []corev1.PodCondition{{Type: corev1.PodScheduled, Status: corev1.ConditionFalse, Reason: "Unschedulable",
		Message: "0/3 nodes are available: 3 Insufficient memory."}}
	starting := attachmentPod("hp-volume-new", "virt-launcher-vm-a-x", corev1.PodPending, "pvc-held")
	starting.CreationTimestamp = metav1.NewTime(young)
	pulling := attachmentPod("hp-volume-pull", "virt-launcher-vm-a-x", corev1.PodPending, "pvc-a", "pvc-b")
	pulling.CreationTimestamp = metav1.NewTime(old)
	pulling.Status.ContainerStatuses = []corev1.ContainerStatus{{Name: "hotplug-disk", State: corev1.ContainerState{
		Waiting: &corev1.ContainerStateWaiting{Reason: "ImagePullBackOff", Message: "back-off pulling image"}}}}
	released := pv("pv-released", "pvc-released")
	released.Status.Phase = corev1.VolumeReleased
	nodeA := node("node-a", "")
	nodeA.Status.Conditions = []corev1.NodeCondition{{Type: corev1.NodeReady, Status: corev1.ConditionTrue}}
	// pvc-held is in vm-a; pvc-gone-from-vm is not, and nothing asks for it;
	// pvc-attaching is not in vm-a yet, its VolumeAttachment is under way.
	nodeA.Status.VolumesInUse = []corev1.UniqueVolumeName{inUse("pvc-held"), inUse("pvc-gone-from-vm"), inUse("pvc-attaching")}
	in := Input{Driver: drv, Namespace: "ns", Now: now, SlowAfter: time.Minute, GuestRead: true, NetworkFSRead: true, HostPodsRead: true,
		VMs:  []kubevirtv1.VirtualMachine{vm("vm-a", []string{"pvc-held"})},
		VMIs: []kubevirtv1.VirtualMachineInstance{vmi("vm-a", map[string]kubevirtv1.VolumePhase{"pvc-held": kubevirtv1.VolumeReady})},
		VolumeAttachments: []storagev1.VolumeAttachment{va("csi-held", "pv-held", "node-a", true),
			va("csi-attaching", "pv-attaching", "node-a", false)},
		PersistentVolumes: []corev1.PersistentVolume{pv("pv-held", "pvc-held"), pv("pv-attaching", "pvc-attaching"),
			pv("pv-gone-from-vm", "pvc-gone-from-vm"), pv("pv-missing", "pvc-missing"), pv("pv-pending", "pvc-pending"),
			pv("pv-new", "pvc-new"), pv("pv-lost", "pvc-lost"), released},
		HostClaims: []corev1.PersistentVolumeClaim{claimIn("pvc-held", corev1.ClaimBound, old), claimIn("pvc-attaching", corev1.ClaimBound, old),
			claimIn("pvc-gone-from-vm", corev1.ClaimBound, old), claimIn("pvc-pending", corev1.ClaimPending, old),
			claimIn("pvc-new", corev1.ClaimPending, young), claimIn("pvc-lost", corev1.ClaimLost, old)},
		CSINodes: []storagev1.CSINode{csiNode("node-a", "vm-a"), csiNode("node-z", "vm-deleted")},
		Nodes:    []corev1.Node{nodeA},
		HostPods: []corev1.Pod{launcher("virt-launcher-vm-a-x", "vm-a"), stuck, starting, pulling},
	}
	findings := Check(in)
	var got []string
	for _, f := range findings {
		got = append(got, f.Kind+"/"+f.Volume+"/"+f.VM+"/"+f.Node)
	}
	want := []string{
		AttachmentPodPending + "//vm-a/",
		AttachmentPodPending + "/pvc-held/vm-a/",
		InUseNotInVM + "/pvc-gone-from-vm/vm-a/node-a",
		HostClaimLost + "/pvc-lost//",
		HostClaimMissing + "/pvc-missing//",
		HostClaimPending + "/pvc-pending//",
		CSINodeUnknownVM + "//vm-deleted/node-z",
	}
	slices.Sort(got)
	slices.Sort(want)
	if !slices.Equal(got, want) {
		t.Fatalf("findings\n%v\nwant\n%v", got, want)
	}
	for _, f := range findings {
		switch {
		case f.Kind == InUseNotInVM && !f.Info:
			t.Errorf("a volume listed in use but not in the VM must be informational: %s", f)
		case f.Kind != InUseNotInVM && f.Info:
			t.Errorf("%s must count as a disagreement", f)
		case f.Kind == AttachmentPodPending && f.Volume == "pvc-held" && !strings.Contains(f.Detail, "Unschedulable: 0/3 nodes are available"):
			t.Errorf("the Pending attachment pod's finding does not give the scheduler's reason: %s", f)
		case f.Kind == AttachmentPodPending && f.Volume == "" && (!strings.Contains(f.Detail, "ImagePullBackOff: back-off") || !strings.Contains(f.Detail, "pvc-a, pvc-b")):
			t.Errorf("the attachment pod's finding does not give the waiting container's reason and its claims: %s", f)
		}
	}
}

// TestHostPodsOfTheSimulatorShape: an attachment pod controlled by the VMI
// itself (no virt-launcher pod in between) is still told to be its VM's.
func TestHostPodsOfTheSimulatorShape(t *testing.T) {
	p := attachmentPod("hp-volume-x", "", corev1.PodPending, "pvc-1")
	p.OwnerReferences = []metav1.OwnerReference{{Kind: "VirtualMachineInstance", Name: "vm-b", Controller: ptr.To(true)}}
	if got := attachmentPodVM(&p, nil); got != "vm-b" {
		t.Errorf("VM of an attachment pod the VMI controls: %q, want vm-b", got)
	}
}
