package realkubevirt

import (
	"context"
	"slices"
	"testing"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/kubernetes/fake"
	"k8s.io/client-go/tools/cache"
	kubevirtv1 "kubevirt.io/api/core/v1"
)

// With real kubelets on the host nodes the kubelet stand-in stands aside:
// it binds no pod and writes no pod status; without, it binds a launcher.
func TestKubeletStandInStandsAsideForRealKubelets(t *testing.T) {
	for _, kubelets := range []bool{true, false} {
		pod := &corev1.Pod{ObjectMeta: metav1.ObjectMeta{Name: "virt-launcher-vm-x", Namespace: "guests",
			Labels: map[string]string{kubevirtv1.AppLabel: launcherLabelValue}}}
		kube := fake.NewClientset(pod)
		a := testAgents(t, kube, []string{"n"}, pod)
		a.kubelets = kubelets
		if err := a.syncPod(context.Background(), pod.Namespace, pod.Name); err != nil {
			t.Fatal(err)
		}
		var writes []string
		for _, act := range kube.Actions() {
			writes = append(writes, act.GetVerb()+" "+act.GetResource().Resource+"/"+act.GetSubresource())
		}
		if kubelets && len(writes) != 0 {
			t.Errorf("with real kubelets the stand-in wrote %v, want nothing", writes)
		}
		if !kubelets && !slices.Contains(writes, "create pods/binding") {
			t.Errorf("without real kubelets the stand-in wrote %v, want the launcher bound", writes)
		}
	}
}

// With real host kubelets, virt-handler finds a volume's device in an
// attachment pod only once the host kubelet published it, which it does
// before it starts the pod's container: a pod still Pending (scheduled, its
// volume being attached) offers its UID and no device.
func TestAttachmentPodOffersDevicesOnlyOncePublished(t *testing.T) {
	vmi := &kubevirtv1.VirtualMachineInstance{ObjectMeta: metav1.ObjectMeta{Name: "vm", Namespace: "guests", UID: "vmi-uid"}}
	launcher := &corev1.Pod{ObjectMeta: metav1.ObjectMeta{Name: "virt-launcher-vm-x", Namespace: "guests", UID: "launcher-uid",
		Labels: map[string]string{kubevirtv1.AppLabel: launcherLabelValue, kubevirtv1.CreatedByLabel: "vmi-uid"}}}
	pod := &corev1.Pod{
		ObjectMeta: metav1.ObjectMeta{Name: "hp-volume-x", Namespace: "guests", UID: "pod-uid",
			Labels:          map[string]string{kubevirtv1.AppLabel: attachmentLabelValue},
			OwnerReferences: []metav1.OwnerReference{{Kind: "Pod", Name: launcher.Name, UID: launcher.UID}}},
		Spec: corev1.PodSpec{NodeName: "harvester-0", Volumes: []corev1.Volume{
			{Name: "hotplug-disks", VolumeSource: corev1.VolumeSource{EmptyDir: &corev1.EmptyDirVolumeSource{}}},
			{Name: "vol-a", VolumeSource: corev1.VolumeSource{PersistentVolumeClaim: &corev1.PersistentVolumeClaimVolumeSource{ClaimName: "pvc-a"}}},
		}},
		Status: corev1.PodStatus{Phase: corev1.PodPending, ContainerStatuses: []corev1.ContainerStatus{{
			Name: "hotplug-disk", State: corev1.ContainerState{Waiting: &corev1.ContainerStateWaiting{Reason: "ContainerCreating"}},
		}}},
	}
	a := testAgents(t, fake.NewClientset(), []string{"harvester-0"}, launcher, pod)
	a.kubelets = true
	got := a.attachmentPods(vmi)
	if len(got) != 1 || got[0].UID != pod.UID || len(got[0].Volumes) != 0 {
		t.Fatalf("pending attachment pod as virt-handler finds it: %+v, want its UID and no device", got)
	}

	running := pod.DeepCopy()
	running.Status.Phase = corev1.PodRunning
	running.Status.ContainerStatuses[0].State = corev1.ContainerState{Running: &corev1.ContainerStateRunning{}}
	if err := a.pods.Update(running); err != nil {
		t.Fatal(err)
	}
	got = a.attachmentPods(vmi)
	if len(got) != 1 || !slices.Equal(got[0].Volumes, []string{"vol-a"}) {
		t.Fatalf("running attachment pod as virt-handler finds it: %+v, want the device of vol-a", got)
	}
}

// testAgents returns node agents for nodes over kube, whose pod cache (the
// informer's indexer, by namespace) holds pods.
func testAgents(t *testing.T, kube *fake.Clientset, nodes []string, pods ...*corev1.Pod) *nodeAgents {
	t.Helper()
	a := newNodeAgents(kube, nil, nil, nodes, nil)
	a.pods = cache.NewIndexer(cache.MetaNamespaceKeyFunc, cache.Indexers{cache.NamespaceIndex: cache.MetaNamespaceIndexFunc})
	for _, p := range pods {
		if err := a.pods.Add(p); err != nil {
			t.Fatal(err)
		}
	}
	return a
}
