package kubevirtsim

import (
	"context"
	"slices"
	"testing"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/client-go/kubernetes/fake"
	corelisters "k8s.io/client-go/listers/core/v1"
	k8stesting "k8s.io/client-go/testing"
	"k8s.io/client-go/tools/cache"
	"k8s.io/klog/v2"
	"k8s.io/utils/ptr"
	kubevirtv1 "kubevirt.io/api/core/v1"
)

// kubeletCluster is the part of a cluster with Options.Kubelets that
// attachment pod creation reads: a fake API and a pod cache holding pods.
func kubeletCluster(t *testing.T, pods ...*corev1.Pod) *cluster {
	t.Helper()
	idx := cache.NewIndexer(cache.MetaNamespaceKeyFunc, cache.Indexers{cache.NamespaceIndex: cache.MetaNamespaceIndexFunc})
	for _, p := range pods {
		if err := idx.Add(p); err != nil {
			t.Fatal(err)
		}
	}
	return &cluster{opts: Options{Kubelets: true}, kube: fake.NewClientset(), podLister: corelisters.NewPodLister(idx), log: klog.Background()}
}

func runningLauncher(vmi *kubevirtv1.VirtualMachineInstance, node string) *corev1.Pod {
	return &corev1.Pod{
		ObjectMeta: metav1.ObjectMeta{Name: launcherName(vmi), Namespace: vmi.Namespace, UID: "launcher-uid",
			Labels: map[string]string{labelAttachmentPod: valueLauncherPod, kubevirtv1.CreatedByLabel: string(vmi.UID), labelAttachmentPodVMI: vmi.Name}},
		Spec:   corev1.PodSpec{NodeName: node, Tolerations: []corev1.Toleration{{Key: "maintenance", Operator: corev1.TolerationOpExists}}},
		Status: corev1.PodStatus{Phase: corev1.PodRunning},
	}
}

// With real kubelets, the attachment pod is the one KubeVirt renders: the
// scheduler places it by its required node affinity to the launcher's
// node (no node name), it carries the launcher's tolerations and is owned
// by the launcher, and its block claim is a device of its container,
// under the VMI volume's name.
func TestAttachmentPodForRealKubeletsAsKubeVirtRendersIt(t *testing.T) {
	vmi := &kubevirtv1.VirtualMachineInstance{
		ObjectMeta: metav1.ObjectMeta{Name: "vm", Namespace: "guests", UID: "vmi-uid-0123"},
		Status:     kubevirtv1.VirtualMachineInstanceStatus{NodeName: "harvester-2", Phase: kubevirtv1.Running},
	}
	launcher := runningLauncher(vmi, "harvester-2")
	c := kubeletCluster(t, launcher)
	v := newVMIController(c, nil)
	pvc := &corev1.PersistentVolumeClaim{ObjectMeta: metav1.ObjectMeta{Name: "pvc-a", Namespace: "guests", UID: "pvc-uid"},
		Spec: corev1.PersistentVolumeClaimSpec{VolumeMode: ptr.To(corev1.PersistentVolumeBlock)}}
	pod, err := v.createAttachmentPod(context.Background(), vmi, []hotVolume{{name: "vol-a", claim: "pvc-a", pvc: pvc}})
	if err != nil {
		t.Fatal(err)
	}
	if pod.Spec.NodeName != "" {
		t.Errorf("attachment pod written with node %q, want none: the scheduler places it", pod.Spec.NodeName)
	}
	if !requiresHostname(pod, "harvester-2") {
		t.Errorf("attachment pod affinity %+v, want required node affinity to the launcher's node harvester-2", pod.Spec.Affinity)
	}
	if !slices.Equal(pod.Spec.Tolerations, launcher.Spec.Tolerations) {
		t.Errorf("attachment pod tolerations %v, want the launcher's %v", pod.Spec.Tolerations, launcher.Spec.Tolerations)
	}
	if ref := metav1.GetControllerOf(pod); ref == nil || ref.Kind != "Pod" || ref.UID != launcher.UID {
		t.Errorf("attachment pod controller %+v, want the launcher pod", ref)
	}
	if !c.ownedByLauncherOf(pod, vmi) {
		t.Error("the simulator does not find the attachment pod as the VMI's")
	}
	if !slices.ContainsFunc(pod.Spec.Volumes, func(vol corev1.Volume) bool {
		return vol.Name == "vol-a" && vol.PersistentVolumeClaim != nil && vol.PersistentVolumeClaim.ClaimName == "pvc-a"
	}) {
		t.Errorf("attachment pod volumes %+v, want vol-a from claim pvc-a", pod.Spec.Volumes)
	}
	if d := pod.Spec.Containers[0].VolumeDevices; len(d) != 1 || d[0].Name != "vol-a" || d[0].DevicePath != "/path/vol-a/pvc-uid" {
		t.Errorf("attachment pod devices %+v, want vol-a at /path/vol-a/pvc-uid", d)
	}
}

// Without a running launcher (no node yet) no attachment pod is written.
func TestAttachmentPodForRealKubeletsWaitsForTheLauncher(t *testing.T) {
	vmi := &kubevirtv1.VirtualMachineInstance{ObjectMeta: metav1.ObjectMeta{Name: "vm", Namespace: "guests", UID: "vmi-uid-0123"}}
	pending := runningLauncher(vmi, "")
	pending.Status.Phase = corev1.PodPending
	c := kubeletCluster(t, pending)
	if _, err := newVMIController(c, nil).createAttachmentPod(context.Background(), vmi, []hotVolume{{name: "vol-a", claim: "pvc-a"}}); err == nil {
		t.Fatal("attachment pod created before its launcher runs")
	}
	if acts := c.kube.(*fake.Clientset).Actions(); len(acts) != 0 {
		t.Errorf("API writes %v, want none", acts)
	}
}

// With real kubelets, virt-handler's feed offers an attachment pod's
// devices only once the host kubelet published them (its container
// started); the simulator's own kubelet starts a pod and publishes it at
// once, so without real kubelets every listed volume is offered.
func TestHandlerFeedOffersOnlyPublishedDevices(t *testing.T) {
	pod := &corev1.Pod{
		ObjectMeta: metav1.ObjectMeta{Name: "hp-volume-x", Namespace: "guests", UID: "pod-uid",
			Annotations: map[string]string{annotationAttachmentPodVolumes: `["vol-a"]`}},
		Spec: corev1.PodSpec{Volumes: []corev1.Volume{
			{Name: "vol-a", VolumeSource: corev1.VolumeSource{PersistentVolumeClaim: &corev1.PersistentVolumeClaimVolumeSource{ClaimName: "pvc-a"}}},
		}},
		Status: corev1.PodStatus{Phase: corev1.PodPending},
	}
	h := &virtHandler{c: &cluster{opts: Options{Kubelets: true}}}
	if got := h.handlerPods([]*corev1.Pod{pod}); len(got) != 1 || len(got[0].Volumes) != 0 {
		t.Errorf("pending pod under real kubelets: %+v, want no device", got)
	}
	running := pod.DeepCopy()
	running.Status.Phase = corev1.PodRunning
	running.Status.ContainerStatuses = []corev1.ContainerStatus{{Name: "hotplug-disk", State: corev1.ContainerState{Running: &corev1.ContainerStateRunning{}}}}
	if got := h.handlerPods([]*corev1.Pod{running}); len(got) != 1 || !slices.Equal(got[0].Volumes, []string{"vol-a"}) {
		t.Errorf("running pod under real kubelets: %+v, want vol-a", got)
	}
	h.c.opts.Kubelets = false
	if got := h.handlerPods([]*corev1.Pod{pod}); len(got) != 1 || !slices.Equal(got[0].Volumes, []string{"vol-a"}) {
		t.Errorf("the simulator's own kubelet: %+v, want vol-a as before", got)
	}
}

func requiresHostname(pod *corev1.Pod, node string) bool {
	a := pod.Spec.Affinity
	if a == nil || a.NodeAffinity == nil || a.NodeAffinity.RequiredDuringSchedulingIgnoredDuringExecution == nil {
		return false
	}
	for _, term := range a.NodeAffinity.RequiredDuringSchedulingIgnoredDuringExecution.NodeSelectorTerms {
		for _, r := range term.MatchExpressions {
			if r.Key == corev1.LabelHostname && r.Operator == corev1.NodeSelectorOpIn && slices.Equal(r.Values, []string{node}) {
				return true
			}
		}
	}
	return false
}

// During a live migration the VMI has two virt-launcher pods; its current
// one is the pod on status.nodeName, so the target's becomes the VMI's only
// at the hand-off.
func TestLauncherPodIsTheOneOnTheVMINode(t *testing.T) {
	vmi := &kubevirtv1.VirtualMachineInstance{ObjectMeta: metav1.ObjectMeta{Name: "vm", Namespace: "guests", UID: "vmi-uid-0123"}}
	source := runningLauncher(vmi, "harvester-0")
	target := runningLauncher(vmi, "harvester-1")
	target.Name, target.UID = "virt-launcher-vm-target", "target-uid"
	target.Labels[kubevirtv1.MigrationJobLabel] = "mig-uid"
	c := kubeletCluster(t, source, target)
	for node, want := range map[string]types.UID{"": source.UID, "harvester-0": source.UID, "harvester-1": target.UID} {
		vmi.Status.NodeName = node
		got := c.launcherPod(vmi)
		if got == nil {
			t.Errorf("VMI on %q: no current launcher, want %s", node, want)
		} else if got.UID != want {
			t.Errorf("VMI on %q: current launcher %s, want %s", node, got.UID, want)
		}
	}
}

// With real kubelets an attachment pod whose virt-launcher pod is gone is
// deleted on the VMI's next pass (no garbage collector runs on the host);
// the current launcher's stays.
func TestOrphanedAttachmentPodOfAGoneLauncherIsDeleted(t *testing.T) {
	vmi := &kubevirtv1.VirtualMachineInstance{
		ObjectMeta: metav1.ObjectMeta{Name: "vm", Namespace: "guests", UID: "vmi-uid-0123"},
		Status:     kubevirtv1.VirtualMachineInstanceStatus{NodeName: "harvester-1", Phase: kubevirtv1.Running},
	}
	launcher := runningLauncher(vmi, "harvester-1")
	owned := func(name string, owner types.UID) *corev1.Pod {
		return &corev1.Pod{ObjectMeta: metav1.ObjectMeta{Name: name, Namespace: "guests", UID: types.UID(name),
			Labels:          map[string]string{labelAttachmentPod: valueAttachmentPod, labelAttachmentPodVMI: vmi.Name},
			OwnerReferences: []metav1.OwnerReference{{APIVersion: "v1", Kind: "Pod", Name: "l", UID: owner, Controller: ptr.To(true)}}}}
	}
	c := kubeletCluster(t, launcher, owned("hp-volume-current", launcher.UID), owned("hp-volume-orphan", "gone-launcher-uid"))
	if err := newVMIController(c, nil).sweepOtherNodes(context.Background(), vmi); err != nil {
		t.Fatal(err)
	}
	var deleted []string
	for _, a := range c.kube.(*fake.Clientset).Actions() {
		if d, ok := a.(k8stesting.DeleteAction); ok {
			deleted = append(deleted, d.GetName())
		}
	}
	if !slices.Equal(deleted, []string{"hp-volume-orphan"}) {
		t.Errorf("deleted %v, want only hp-volume-orphan", deleted)
	}
}
