package guest

import (
	"context"
	"os"
	"time"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/kubernetes"
	"k8s.io/klog/v2"
)

// Events writes Events on guest Nodes with one create each. These Events are
// rare (a forced unplug, a fenced node), so nothing is aggregated and the
// identity needs only "create" on events.
type Events struct {
	Client kubernetes.Interface
	// Component names the writer in the Event's source.
	Component string
	// Instance names this replica (default: the hostname).
	Instance string
}

// NodeEvent implements EventSink. A failure is logged, never returned: the
// Event reports a decision already taken.
func (e Events) NodeEvent(ctx context.Context, node *corev1.Node, eventType, reason, message string) {
	instance := e.Instance
	if instance == "" {
		instance, _ = os.Hostname()
	}
	now := metav1.NewTime(time.Now())
	ev := &corev1.Event{
		// Node Events live in the default namespace, where kubelet and
		// kubectl describe put and look for them.
		ObjectMeta: metav1.ObjectMeta{GenerateName: node.Name + ".", Namespace: metav1.NamespaceDefault},
		InvolvedObject: corev1.ObjectReference{
			APIVersion: "v1", Kind: "Node", Name: node.Name, UID: node.UID,
		},
		Reason: reason, Message: message, Type: eventType,
		Source:         corev1.EventSource{Component: e.Component},
		FirstTimestamp: now, LastTimestamp: now, Count: 1,
		ReportingController: e.Component, ReportingInstance: instance,
	}
	if _, err := e.Client.CoreV1().Events(metav1.NamespaceDefault).Create(ctx, ev, metav1.CreateOptions{}); err != nil {
		klog.FromContext(ctx).Error(err, "cannot write an Event on the guest node", "node", node.Name, "reason", reason, "message", message)
	}
}
