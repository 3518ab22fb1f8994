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
		a := newNodeAgents(kube, nil, nil, []string{"n"}, nil)
		a.kubelets = kubelets
		a.pods = cache.NewIndexer(cache.MetaNamespaceKeyFunc, cache.Indexers{})
		if err := a.pods.Add(pod); err != nil {
			t.Fatal(err)
		}
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
