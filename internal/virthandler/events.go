package virthandler

import (
	"context"
	"fmt"
	"hash/fnv"

	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/kubernetes"
	kubevirtv1 "kubevirt.io/api/core/v1"
)

// RecordEvents writes a pass's Events on the VMI as virt-handler's recorder
// does, Warning and from component virt-handler. One Event per reason and
// message: a repeat finds it there and adds nothing, so a VMI that fails
// every second costs one write, not one per pass.
func RecordEvents(ctx context.Context, kube kubernetes.Interface, vmi *kubevirtv1.VirtualMachineInstance, events []Event) error {
	for _, e := range events {
		h := fnv.New32a()
		_, _ = h.Write([]byte(e.Reason + "\x00" + e.Message))
		now := metav1.Now()
		ev := &corev1.Event{
			ObjectMeta: metav1.ObjectMeta{Name: fmt.Sprintf("%s.%s.%08x", vmi.Name, vmi.UID, h.Sum32()), Namespace: vmi.Namespace},
			InvolvedObject: corev1.ObjectReference{
				APIVersion: kubevirtv1.SchemeGroupVersion.String(), Kind: "VirtualMachineInstance",
				Namespace: vmi.Namespace, Name: vmi.Name, UID: vmi.UID,
			},
			Reason: e.Reason, Message: e.Message, Type: corev1.EventTypeWarning,
			Source:         corev1.EventSource{Component: "virt-handler"},
			FirstTimestamp: now, LastTimestamp: now, Count: 1,
		}
		if _, err := kube.CoreV1().Events(vmi.Namespace).Create(ctx, ev, metav1.CreateOptions{}); err != nil && !apierrors.IsAlreadyExists(err) {
			return err
		}
	}
	return nil
}
